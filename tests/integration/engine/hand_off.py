"""A disaggregated hand-off between two engines in one process, without Ray:
prefill-only on one engine, its blocks pulled over a real transfer backend
(the socket fallback: owner and puller each on their own listener) into
blocks the other engine reserved, the lease released, decode committed.

    prefill engine                      decode engine
    add_request(prefill_only) -> step   reserve_external -> alloc.missing_block_ids
    done.prefill.block_ids[cached:] ==pull==> missing_block_ids
    release_lease                       commit_external(first token) -> step ...

A resumed request passes its output so far to add_request and
reserve_external alike: the blocks hold prompt + prior output.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pdcluster.services.engine.engine import Engine
from pdcluster.services.engine.outputs import RequestOutput
from pdcluster.services.sampling_params import SamplingParams

SECRET = b"engine-hand-off-test-secret-0123456789"
Requests = Sequence[tuple[str, list[int], SamplingParams]]


def prefill_and_pull(prefill: Engine, decode: Engine, requests: Requests,
                     priors: Mapping[str, Sequence[int]] | None = None):
    """Prefills every request on ``prefill``, pulls its blocks into ``decode``
    and commits them there (not yet decoded).  ``priors``: a resumed
    request's output so far, by request id (its K/V travels with the
    prompt's).  Returns (first token per request id, bytes pulled, blocks pulled)."""
    done = prefill_only(prefill, requests, priors)
    return pull_and_commit(prefill, decode, requests, done, priors)


def prefill_only(prefill: Engine, requests: Requests, priors: Mapping[str, Sequence[int]] | None = None
                 ) -> dict[str, RequestOutput]:
    """Each request's last output on ``prefill`` (its blocks under lease)."""
    priors = priors or {}
    for request_id, prompt, params in requests:
        prefill.add_request(request_id, prompt, params, prefill_only=True,
                            prior_output_token_ids=priors.get(request_id, ()))
    outs = []
    while prefill.has_unfinished():
        outs += prefill.step()
    return {o.request_id: o for o in outs if o.finished}


def pull_and_commit(prefill: Engine, decode: Engine, requests: Requests, done: Mapping[str, RequestOutput],
                    priors: Mapping[str, Sequence[int]] | None = None):
    """The decode half of prefill_and_pull, from ``prefill_only``'s outputs."""
    from pdcluster.transfer import KVLayout, create_backend

    priors = priors or {}
    first, num_bytes, num_blocks = {}, 0, 0
    with create_backend("fallback", peer_id="prefill-0", secret=SECRET) as owner, \
            create_backend("fallback", peer_id="decode-0", secret=SECRET,
                           timeout_s=120.0) as puller:  # a hang guard: make test may run this starved
        owner.register_pool(prefill.kv.kv_pool, KVLayout.of_pool(prefill.kv.kv_pool, prefill.hash_seed))
        puller.register_pool(decode.kv.kv_pool, KVLayout.of_pool(decode.kv.kv_pool, decode.hash_seed))
        for request_id, prompt, params in requests:
            alloc = decode.reserve_external(request_id, prompt, params,
                                            prior_output_token_ids=priors.get(request_id, ()))
            assert alloc is not None, "the decode engine's pool is too small for the test"
            remote = done[request_id].prefill.block_ids[alloc.num_cached_blocks:]
            assert len(remote) == len(alloc.missing_block_ids), (remote, alloc)
            if remote:
                stats = puller.pull(owner.describe(), list(remote), list(alloc.missing_block_ids))
                num_bytes, num_blocks = num_bytes + stats.num_bytes, num_blocks + len(remote)
            assert prefill.release_lease(request_id)
            first[request_id] = done[request_id].prefill.first_token_id
            decode.commit_external(request_id, first[request_id])
    return first, num_bytes, num_blocks


def decode_all(decode: Engine, first: dict[str, int]) -> dict[str, list[int]]:
    """Steps ``decode`` until every committed request finishes; each request's
    tokens, the prefill side's first token included."""
    tokens = {request_id: [t] for request_id, t in first.items()}
    while decode.has_unfinished():
        for o in decode.step():
            tokens[o.request_id] += o.new_token_ids
    return tokens
