"""A NIXL READ that times out and cannot be cancelled never lands in blocks
another request owns (issue 33 a).  Real NIXL agents in one process; a hold
around the puller's agent stands for a READ whose completion is delayed past
the puller's timeout: it is posted late (when the test lets it land), reports
PROC until then, and refuses release meanwhile, as NIXL does for an active
transfer it cannot cancel.

Before: the pull raised a plain TransferError, the decode side aborted the
reservation and the blocks went back to the free list while the READ could
still write them.  Now it raises TransferInDoubtError naming the blocks; the
engine holds them (quarantine) until the backend has seen the transfer end."""

import threading

import pytest

from pdcluster.transfer.errors import TransferInDoubtError
from transfer_lease_fakes import owner_and_puller, same_bytes, wait_until


class HeldAgent:
    """The puller's real NIXL agent, with every READ held until ``land()``
    (``refuse_release``: releases fail even after, as for a handle NIXL lost track of)."""

    def __init__(self, agent):
        self._agent, self._held, self.landed, self.refuse_release = agent, [], threading.Event(), False

    def __getattr__(self, name):
        return getattr(self._agent, name)

    def transfer(self, handle):
        if self.landed.is_set():
            return self._agent.transfer(handle)
        self._held.append(handle)
        return "PROC"

    def check_xfer_state(self, handle):
        if handle in self._held and not self.landed.is_set():
            return "PROC"
        return self._agent.check_xfer_state(handle)

    def release_xfer_handle(self, handle):
        if self.refuse_release or (handle in self._held and not self.landed.is_set()):
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE: transfer in progress")  # as nixl for an active READ
        return self._agent.release_xfer_handle(handle)

    def land(self):
        """The held READs run now (same-host copies finish inside transfer())."""
        if self.landed.is_set():
            return
        for handle in self._held:
            assert self._agent.transfer(handle) in ("DONE", "PROC")
            while self._agent.check_xfer_state(handle) == "PROC":
                pass
        self.landed.set()


@pytest.fixture
def held():
    for owner, puller, owner_pool, puller_pool in owner_and_puller("nixl"):
        agent = HeldAgent(puller._agent)
        puller._agent = agent
        yield owner, puller, owner_pool, puller_pool, agent
        agent.land()  # nothing left posted when the agents close
        agent.refuse_release = False


def test_a_read_held_past_the_timeout_is_in_doubt_until_it_lands(held):
    owner, puller, owner_pool, puller_pool, agent = held
    before = puller_pool[[10, 11]].clone()
    with pytest.raises(TransferInDoubtError, match="could not cancel its READ") as e:
        puller.pull(owner.describe(), [3, 4], [10, 11], timeout_s=0.2)
    assert e.value.local_block_ids == (10, 11) and not e.value.settled()
    assert puller.num_unsettled_blocks == 2
    assert same_bytes(puller_pool[[10, 11]], before)  # nothing landed yet ...
    agent.land()                                      # ... now the late READ writes them
    assert same_bytes(puller_pool[[10, 11]], owner_pool[[3, 4]])
    assert wait_until(e.value.settled)                # the ticker saw it end and released it
    assert puller.num_unsettled_blocks == 0


def test_a_read_that_lands_is_not_in_doubt_even_if_its_release_fails(held):
    owner, puller, owner_pool, puller_pool, agent = held
    agent.land()  # reads run at once from here on; their releases fail
    agent.refuse_release = True
    puller.pull(owner.describe(), [5], [12], timeout_s=2.0)
    assert same_bytes(puller_pool[[12]], owner_pool[[5]]) and puller.num_unsettled_blocks == 0
