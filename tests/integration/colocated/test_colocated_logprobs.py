"""The logprobs / echo / n tests of the disaggregated cluster, run on the
colocated one (fp32: also against transformers within 1e-3)."""

from tests.integration.cluster.test_cluster_logprobs import *  # noqa: F403 - the same tests, this directory's cluster
