"""Multi-node pieces without launchers: the layout from the environment, the per-boundary transport,
the TCPStore rendezvous (two "nodes" as two threads of this process on loopback) and the node agents'
channel (fail relay, checkpoint reports, finish, a silent node)."""
from __future__ import annotations

import socket
import threading
import time

import pytest
from omegaconf import OmegaConf

from npu_train.config import Config
from npu_train.errors import ConfigError, JobFailed
from npu_train.hardware import Card
from npu_train.runtime.agent import NodeLink
from npu_train.pipeline.hosts import boundary_transports
from npu_train.runtime.nodes import (NodeLayout, NodePlan, Rendezvous, RendezvousError, config_digest,
                                     route_address)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ENV = {"NNODES": "3", "NODE_RANK": "2", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500"}


def test_layout_from_env():
    assert NodeLayout.from_env({}) is None
    assert NodeLayout.from_env({"NNODES": "1", "NODE_RANK": "0"}) is None  # one node: exactly as today
    lo = NodeLayout.from_env(ENV)
    assert (lo.nnodes, lo.node_rank, lo.master_addr, lo.master_port, lo.is_master) == (3, 2, "10.0.0.5", 29500, False)
    # Indexed Job: JOB_COMPLETION_INDEX when NODE_RANK is unset; NODE_RANK wins when both are set
    env = dict(ENV, JOB_COMPLETION_INDEX="1")
    del env["NODE_RANK"]
    assert NodeLayout.from_env(env).node_rank == 1
    assert NodeLayout.from_env(dict(ENV, JOB_COMPLETION_INDEX="1")).node_rank == 2
    # node n's cards get the next contiguous global ranks in node order
    assert [list(r) for r in lo.ranks_of([1, 2, 3])] == [[0], [1, 2], [3, 4, 5]]


@pytest.mark.parametrize("change,needle", [
    ({"NODE_RANK": None}, "NODE_RANK"), ({"NODE_RANK": "3"}, "outside 0..2"), ({"MASTER_ADDR": None}, "MASTER_ADDR"),
    ({"MASTER_PORT": None}, "MASTER_PORT"), ({"NNODES": "two"}, "NNODES"), ({"MASTER_PORT": "70000"}, "MASTER_PORT"),
])
def test_layout_errors_name_the_variable(change, needle):
    env = dict(ENV)
    for k, v in change.items():
        if v is None:
            env.pop(k)
        else:
            env[k] = v
    with pytest.raises(ConfigError, match=needle):
        NodeLayout.from_env(env)


def test_boundary_transport_is_inline_exactly_across_nodes():
    # stages on nodes 0,0,1,1,1,2: boundaries 1|2 and 4|5 cross nodes
    assert boundary_transports([0, 0, 1, 1, 1, 2], "shm") == ("shm", "inline", "shm", "shm", "inline")
    assert boundary_transports([0, 1], "shm") == ("inline",)
    assert boundary_transports([0, 0, 1], "inline") == ("inline", "inline")
    plan = NodePlan(node=1, nnodes=3, node_of_rank=(0, 0, 1, 1, 1, 2), inbox=(), dist_init="", link_addr="",
                    boundary_transport=boundary_transports([0, 0, 1, 1, 1, 2], "shm"))
    assert plan.local_ranks == [2, 3, 4] and plan.local_shm_boundaries() == 2


def test_route_address_of_loopback():
    assert route_address("127.0.0.1") == "127.0.0.1"
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        route_address("no-such-host.invalid")


def _cfg(*dotlist):
    return OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(list(dotlist)))


def test_config_digest_covers_training_settings_not_node_local_ones():
    a = config_digest(_cfg("train.lr=1e-3", "backend=[cpu]", "runtime.host=10.0.0.1"))
    b = config_digest(_cfg("train.lr=1e-3", "backend=[cpu,cpu]", "runtime.host=10.0.0.2", "runtime.threads=3",
                           "checkpoint.dir=/x"))
    assert a == b
    c = config_digest(_cfg("train.lr=2e-3", "data.seq_len=64", "checkpoint.save=false"))
    assert {k for k in a if a[k] != c.get(k)} == {"train.lr", "data.seq_len", "checkpoint.save"}


def _two_rendezvous(timeout=20.0):
    port = _free_port()
    lo0, lo1 = (NodeLayout(2, n, "127.0.0.1", port) for n in (0, 1))
    r0 = Rendezvous(lo0, timeout)
    return r0, Rendezvous(lo1, timeout)


def _both(f0, f1):
    """Run f0 (node 0) and f1 (node 1) concurrently; return (result or exception) of each."""
    out = [None, None]

    def run(i, f):
        try:
            out[i] = f()
        except Exception as e:  # noqa: BLE001
            out[i] = e
    ts = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate((f0, f1))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return out


def test_rendezvous_exchange_in_node_order():
    r0, r1 = _two_rendezvous()
    a, b = _both(lambda: r0.exchange("cards", ["cpu"]), lambda: r1.exchange("cards", ["cpu", "cpu"]))
    assert a == b == [["cpu"], ["cpu", "cpu"]]


def test_rendezvous_names_the_differing_keys_on_every_node():
    r0, r1 = _two_rendezvous()
    d0 = config_digest(_cfg("train.lr=1e-3"))
    d1 = config_digest(_cfg("train.lr=2e-3"))
    e0, e1 = _both(lambda: r0.check_same("config", d0, "settings", "fix it"),
                   lambda: r1.check_same("config", d1, "settings", "fix it"))
    for e in (e0, e1):
        assert isinstance(e, RendezvousError)
        assert "node 1 differs from node 0 in train.lr (node 0: 0.001, node 1: 0.002)" in str(e)
        assert "data.seq_len" not in str(e)


def test_rendezvous_node0_waits_for_a_slow_node_before_leaving_on_a_difference():
    """Node 0 hosts the store and exits on the refusal it computed; a node that reads the values later must
    still find them (it names the same keys), not a closed connection (a heavy-suite run on a loaded host:
    node 1's launcher died with DistNetworkError). Node 0's store is dropped as soon as it raises."""
    import gc

    r0, r1 = _two_rendezvous()
    d0, d1 = config_digest(_cfg("train.lr=1e-3")), config_digest(_cfg("train.lr=2e-3"))
    slow_collect = r1.collect

    def late(topic, nodes=None):
        time.sleep(1.0)  # node 1 reaches its read after node 0 has compared and raised
        return slow_collect(topic, nodes)

    r1.collect = late

    def node0():
        try:
            r0.check_same("config", d0, "settings", "fix it")
        finally:
            r0.store = None  # the launcher exits: its store goes with it
            gc.collect()

    e0, e1 = _both(node0, lambda: r1.check_same("config", d1, "settings", "fix it"))
    for e in (e0, e1):
        assert isinstance(e, RendezvousError), repr(e)
        assert "node 1 differs from node 0 in train.lr (node 0: 0.001, node 1: 0.002)" in str(e)


def test_rendezvous_names_node0_when_its_store_is_gone():
    r0, r1 = _two_rendezvous()
    r1.publish("cards", [])
    r0.store = None
    import gc

    gc.collect()
    with pytest.raises(RendezvousError, match="node 0's rendezvous store closed while this node waited for 'cards'"):
        r1.collect("cards")


def test_rendezvous_abort_stops_the_others_waiting():
    r0, r1 = _two_rendezvous(timeout=60.0)
    r1.abort("error: backend entry 'cuda:7' names a device that does not exist")
    with pytest.raises(RendezvousError, match="node 1 failed while preparing the job: .*cuda:7"):
        r0.collect("cards")


def test_rendezvous_timeout_names_the_missing_node():
    r0, _ = _two_rendezvous(timeout=0.5)
    r0.publish("cards", [])
    with pytest.raises(RendezvousError, match=r"node\(s\) 1 did not publish 'cards'"):
        r0.collect("cards")


def _links(timeout_s=5.0, startup=5.0):
    addr = f"tcp://127.0.0.1:{_free_port()}"
    kw = dict(interval_s=0.05, timeout_s=timeout_s, startup_timeout_s=startup)
    return NodeLink(0, 2, addr, "tok", **kw), NodeLink(1, 2, addr, "tok", **kw)


def _pump_until(links, cond, published=None, limit=2000):
    for _ in range(limit):
        for l in links:
            l.pump(time.monotonic(), (published if published is not None else []).append)
        if cond():
            return
        time.sleep(0.005)
    raise AssertionError("condition not reached")


def test_node_link_checkpoint_reports_and_finish():
    n0, n1 = _links()
    try:
        published = []
        n0.shards_written(4)
        _pump_until([n0, n1], lambda: 1 in n0.contacted and 0 in n1.contacted, published)
        assert published == []  # node 1's shards of step 4 are not written yet
        n1.shards_written(4)
        _pump_until([n0, n1], lambda: published == [4], published)
        assert not n1.all_done()
        _pump_until([n0, n1], lambda: n0.all_done("/ck/step_000004"), published)
        _pump_until([n0, n1], lambda: n1.all_done(), published)
        assert n1.last_ckpt == "/ck/step_000004"
    finally:
        n0.close()
        n1.close()


def test_node_link_failure_notice_reaches_the_other_node():
    n0, n1 = _links()
    try:
        _pump_until([n0, n1], lambda: 1 in n0.contacted and 0 in n1.contacted)
        n1.fail("card node1/cpu:0 (stage 1, layers 3-5 +head) failed during step 2: process killed by signal SIGKILL")
        with pytest.raises(JobFailed, match=r"card node1/cpu:0 \(stage 1.*step 2"):
            _pump_until([n0], lambda: False)
    finally:
        n0.close()
        n1.close()


def test_node_link_silent_node_is_declared_dead():
    n0, n1 = _links(timeout_s=0.3, startup=0.3)
    n1.close()  # node 1's agent is gone (never says anything)
    try:
        with pytest.raises(JobFailed, match="node 1 stopped responding"):
            _pump_until([n0], lambda: False)
    finally:
        n0.close()


def test_exchange_cards_gives_every_node_the_same_global_card_list():
    from npu_train.runtime.nodes import exchange_cards

    r0, r1 = _two_rendezvous()
    c0 = [Card(kind="cpu", index=None, capacity_bytes=100, name="cpu")]
    c1 = [Card(kind="cpu", index=None, capacity_bytes=40, name=f"cpu:{i}") for i in range(2)]
    a, b = _both(lambda: exchange_cards(r0, c0, 4, 1000), lambda: exchange_cards(r1, c1, 2, 500))
    assert a == b
    cards, counts, threads, ram = a
    # node order, then card order; each card keeps its own node's capacity; the smallest thread count
    assert [(c.name, c.capacity_bytes) for c in cards] == [("node0/cpu", 100), ("node1/cpu:0", 40), ("node1/cpu:1", 40)]
    assert (counts, threads, ram) == ([1, 2], 2, [1000, 500])


def test_missing_shards_finds_stages_written_elsewhere(tmp_path):
    """Node 0 publishes only when every stage's shard is in the shared staging dir (not a shared root: error)."""
    import torch

    from npu_train.checkpoint.store import missing_shards, save_shard

    for r in (0, 2):
        save_shard(str(tmp_path), r, {"x": torch.zeros(1)}, {"rank": r})
    assert missing_shards(str(tmp_path), 3) == [1]
    save_shard(str(tmp_path), 1, {"x": torch.zeros(1)}, {"rank": 1})
    assert missing_shards(str(tmp_path), 3) == []
