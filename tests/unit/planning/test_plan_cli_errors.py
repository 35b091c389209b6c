"""Every bad input to `pdcluster plan` ends with exit status 2 and one line
naming the flag (and the valid range, where there is one); never a
traceback, never a plan."""

import subprocess
import sys
from pathlib import Path

import pytest

from pdcluster.services.cli.plan import main

REPO = Path(__file__).resolve().parents[3]
BASE = ["--model", "default", "--rps", "5", "--input-mean", "100", "--output-mean", "50"]

# (extra flags, a piece the message must contain)
BAD_INPUTS = [
    # the nine that used to end in a traceback
    (["--rps", "-5"], "argument --rps: must be a number in (0, 1e9], got '-5'"),
    (["--context", "0"], "argument --context: must be a number in [1, 1e9]"),
    (["--kv-heads", "0"], "argument --kv-heads: must be an integer in [1, 1,024]"),
    (["--params", "0"], "argument --params: must be a number in (0, 1e14]"),
    (["--layers", "0"], "argument --layers: must be an integer in [1, 1,000]"),
    (["--head-dim", "0"], "argument --head-dim: must be an integer in [1, 4,096]"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: must be an integer in [1, 1,000,000]"),
    (["--output-mean", "-10"], "argument --output-mean: must be a number in [1, 1e8]"),
    (["--rps", "inf"], "argument --rps: must be a number in (0, 1e9], got 'inf'"),
    # out of range or not a number
    (["--rps", "nan"], "argument --rps"),
    (["--rps", "0"], "argument --rps: must be a number in (0, 1e9], got '0'"),
    (["--rps", "lots"], "argument --rps"),
    (["--bandwidth-gbs", "-100"], "argument --bandwidth-gbs: must be a number in (0, 1,000,000]"),
    (["--memory-gib", "0"], "argument --memory-gib"),
    (["--tflops", "0"], "argument --tflops"),
    (["--tp", "0"], "argument --tp: must be an integer in [1, 1,024]"),
    (["--model", "llama-3.1-8b", "--tp", "3"], "--tp 3 does not divide the 32 query heads of llama-3.1-8b"),
    (["--heads", "12", "--kv-heads", "4", "--tp", "6"], "--tp 6 neither divides the 4 KV heads"),
    (["--heads", "24", "--kv-heads", "8", "--tp", "3"], "--tp 3 neither divides the 8 KV heads"),
    (["--heads", "0"], "argument --heads"),
    (["--layers", "2.5"], "argument --layers: must be an integer"),
    (["--reserve-fraction", "1"], "argument --reserve-fraction: must be a number in [0, 1)"),
    (["--reserve-gib", "-1"], "argument --reserve-gib"),
    (["--safety", "0"], "argument --safety: must be a number in (0, 1]"),
    (["--mbu", "1.5"], "argument --mbu: must be a number in (0, 1]"),
    (["--mfu", "0"], "argument --mfu"),
    (["--redundancy", "0.5"], "argument --redundancy: must be a number in [1, 100]"),
    (["--price-per-hour", "-1"], "argument --price-per-hour"),
    (["--block-size", "0"], "argument --block-size"),
    (["--input-p95", "0"], "argument --input-p95"),
    (["--ttft", "0"], "argument --ttft: must be a number in (0, 100,000]"),
    (["--tpot", "-1"], "argument --tpot"),
    (["--queue-s", "-1"], "argument --queue-s: must be a number in [0, 100,000]"),
    (["--concurrency", "0"], "argument --concurrency"),
    (["--instance-tok-s", "0"], "argument --instance-tok-s"),
    (["--dwell-s", "-1"], "argument --dwell-s"),
    (["--active-per-instance", "0"], "argument --active-per-instance"),
    (["--kv-safe-per-instance", "-3"], "argument --kv-safe-per-instance"),
    (["--shared-prefix-tokens", "-1"], "argument --shared-prefix-tokens"),
    (["--prefix-hit-rate", "1.5"], "argument --prefix-hit-rate: must be a number in [0, 1]"),
    (["--spec-k", "0"], "argument --spec-k: must be an integer in [1, 64]"),
    (["--spec-accept", "-0.1"], "argument --spec-accept"),
    (["--spec-cost", "2"], "argument --spec-cost: must be a number in (0, 1]"),
    (["--pp", "0"], "argument --pp"),
    (["--micro-batches", "0"], "argument --micro-batches"),
    (["--profile-batches", "1,0"], "argument --profile-batches"),
    (["--weight-dtype", "fp7"], "argument --weight-dtype: invalid choice"),
    # flags that conflict or need each other
    (["--reserve-fraction", "0.1", "--reserve-gib", "2"], "--reserve-gib: not allowed with argument --reserve-fraction"),
    (["--memory-gib", "80", "--memory-gb", "80"], "--memory-gb: not allowed with argument --memory-gib"),
    (["--spec-k", "4"], "also give --spec-accept and --spec-cost"),
    (["--pp", "4"], "also give --micro-batches"),
    (["--prefix-hit-rate", "0.5"], "also give --shared-prefix-tokens"),
    (["--shared-prefix-tokens", "500", "--prefix-hit-rate", "0.5"], "--shared-prefix-tokens 500 exceeds the mean prompt"),
    (["--kv-heads", "4"], "not a multiple of 4 KV heads (--kv-heads)"),
    # plans that cannot be
    (["--context", "100000000"], "no request fits"),
    (["--memory-gib", "0.1"], "no memory left for KV"),
    (["--model", "no-such-model"], "--model 'no-such-model'"),
    (["--workload", "no-such-workload"], "workload 'no-such-workload' not found"),
    (["--json", "/no/such/dir/plan.json"], "--json /no/such/dir/plan.json"),
    (["--config", "/no/such/cluster.yaml"], "/no/such/cluster.yaml"),
]


@pytest.mark.parametrize("flags, message", BAD_INPUTS, ids=[" ".join(f) for f, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(capsys, flags, message):
    assert main([*BASE, *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no plan
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("pdcluster plan: error: ")
    assert message in lines[0]


def test_at_least_25_bad_inputs():
    assert len(BAD_INPUTS) >= 25


@pytest.mark.parametrize("flags", [["--rps", "-5"], ["--head-dim", "0"], ["--context", "100000000"]])
def test_no_traceback_through_pdcluster(flags):
    """The real entry point (pdcluster.services.cli.main, as `pdcluster`), in a fresh interpreter."""
    result = subprocess.run([sys.executable, "-m", "pdcluster.services.cli.main", "plan", *BASE, *flags],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith("pdcluster plan: error: ")


@pytest.mark.parametrize("text, message", [("dtype: [", "not valid YAML"), ("dtype: fp7", "dtype"),
                                           ("- a list", "expected a mapping")])
def test_a_bad_cluster_config_is_one_line_and_exit_2(capsys, tmp_path, text, message):
    config = tmp_path / "cluster.yaml"
    config.write_text(text)
    assert main([*BASE, "--config", str(config)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1, captured.err
    assert message in captured.err


@pytest.mark.parametrize("tp", ["2", "8", "16", "32"])
def test_a_tp_that_splits_or_copies_whole_kv_heads_is_planned(capsys, tp):
    """llama-3.1-8b: 32 query heads, 8 KV heads; 16 and 32 devices hold a copy of one KV head each."""
    assert main([*BASE, "--model", "llama-3.1-8b", "--tp", tp]) == 0, capsys.readouterr().err
