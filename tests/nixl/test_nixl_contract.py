"""The error contract of r2ccl's NIXL backend, through NIXL's agent API (the 1.4.0 wheel), two
agents over loopback in one process:

- a peer whose process ended is NIXL_ERR_REMOTE_DISCONNECT, and a peer started again under the
  same agent name, its metadata loaded again, takes transfers;
- releasing a transfer still in progress is refused at once (NIXL keeps it), and the transfer
  completes;
- host memory registered as GPU memory (VRAM) and unknown backend parameters are refused,
  saying what was wrong;
- NIXL's backend parameters configure the engine (they win over R2CCL_* variables).

Runs in the environment of `scripts/run vllm-test` (tests/nixl).
"""

import time
import uuid

import numpy as np
import pytest

from nixl._api import nixl_agent, nixl_agent_config
import nixl._bindings as bindings

CFG = nixl_agent_config(backends=["R2CCL"])


@pytest.fixture(autouse=True)
def loopback(monkeypatch):
    monkeypatch.setenv("R2CCL_NICS", "lo")


def reg(agent, arr, mem="DRAM"):
    return agent.register_memory(agent.get_reg_descs([(arr.ctypes.data, arr.nbytes, 0, "")], mem))


def descs(agent, arr):
    return agent.get_xfer_descs([(arr.ctypes.data, arr.nbytes, 0)], "DRAM")


def wait_state(agent, handle, timeout=30.0):
    """The transfer's final state ("DONE"), or the exception NIXL raised for it."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            state = agent.check_xfer_state(handle)
        except Exception as e:  # noqa: BLE001 (NIXL raises typed errors)
            return e
        if state != "PROC":
            return state
        time.sleep(0.001)
    pytest.fail(f"the transfer did not end within {timeout} s")


def write(a, src, b_name, dst_descs, tag=b"t"):
    h = a.initialize_xfer("WRITE", descs(a, src), dst_descs, b_name, tag)
    try:
        a.transfer(h)
    except Exception as e:  # noqa: BLE001
        return h, e
    return h, wait_state(a, h)


def test_a_peer_that_ended_is_a_disconnect_and_its_restart_reconnects():
    a = nixl_agent("A-" + uuid.uuid4().hex[:6], CFG)
    b_name = "B-" + uuid.uuid4().hex[:6]
    b = nixl_agent(b_name, CFG)
    src = np.arange(1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    reg(a, src)
    reg(b, dst)
    a.add_remote_agent(b.get_agent_metadata())
    b_descs = descs(b, dst)
    h, state = write(a, src, b_name, b_descs)
    assert state == "DONE" and np.array_equal(src, dst)
    a.release_xfer_handle(h)

    del b  # the agent ends: its engine says goodbye on every rail
    import gc
    gc.collect()
    t0 = time.monotonic()
    outcome = None
    while time.monotonic() - t0 < 15 and outcome is None:
        h, state = write(a, src, b_name, b_descs)
        if isinstance(state, Exception):
            outcome = state
        else:
            time.sleep(0.05)
    assert isinstance(outcome, (bindings.nixlRemoteDisconnectError, bindings.nixlNotFoundError)), \
        outcome
    assert time.monotonic() - t0 < 10

    # Started again under the same name: its new metadata loads, and transfers work.
    b2 = nixl_agent(b_name, CFG)
    dst2 = np.zeros(1 << 20, dtype=np.uint8)
    reg(b2, dst2)
    a.add_remote_agent(b2.get_agent_metadata())
    h, state = write(a, src, b_name, descs(b2, dst2), b"again")
    assert state == "DONE", state
    assert np.array_equal(src, dst2)
    end = time.monotonic() + 10
    got = {}
    while not got and time.monotonic() < end:
        got = b2.get_new_notifs()
        time.sleep(0.01)
    assert got == {a.name: [b"again"]}, got


def test_release_in_progress_is_refused_at_once_and_the_data_still_lands():
    # NIXL 1.4.0 keeps a request whose release the backend refused, and from then on reports
    # that refusal as its state (NIXL_ERR_REPOST_ACTIVE): an engine keeps its buffers (vLLM
    # does). The transfer itself goes on: its bytes and its notification arrive.
    a = nixl_agent("A-" + uuid.uuid4().hex[:6], CFG)
    b = nixl_agent("B-" + uuid.uuid4().hex[:6], CFG)
    size = 256 << 20
    src = np.full(size, 7, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    reg(a, src)
    reg(b, dst)
    a.add_remote_agent(b.get_agent_metadata())
    h = a.initialize_xfer("WRITE", descs(a, src), descs(b, dst), b.name, b"big")
    assert a.transfer(h) == "PROC"
    t0 = time.monotonic()
    with pytest.raises(bindings.nixlRepostActiveError):
        a.release_xfer_handle(h)
    assert time.monotonic() - t0 < 0.5, "releaseReqH blocked"
    end = time.monotonic() + 120
    got = {}
    while not got and time.monotonic() < end:
        got = b.get_new_notifs()
        time.sleep(0.01)
    assert got == {a.name: [b"big"]}, got
    assert np.count_nonzero(dst != 7) == 0
    a.release_xfer_handle(h)  # done now: released


def test_host_memory_given_as_gpu_memory_is_refused_by_name(capfd):
    a = nixl_agent("A-" + uuid.uuid4().hex[:6], CFG)
    buf = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(Exception):
        reg(a, buf, mem="VRAM")
    err = capfd.readouterr().err
    assert (f"the VRAM_SEG region of 4096 bytes at {buf.ctypes.data:#x} (device 0) is not CUDA "
            "device memory of this process (or CUDA is not loaded here)") in err, err


def test_unknown_backend_parameter_is_refused_naming_it(capfd):
    a = nixl_agent("A-" + uuid.uuid4().hex[:6], nixl_agent_config(backends=[]))
    with pytest.raises(Exception):
        a.create_backend("R2CCL", {"nicss": "lo"})
    err = capfd.readouterr().err
    assert "unknown R2CCL backend parameter 'nicss'" in err, err


def test_backend_parameters_win_over_the_environment(monkeypatch, capfd):
    monkeypatch.setenv("R2CCL_NICS", "no-such-nic")
    a = nixl_agent("A-" + uuid.uuid4().hex[:6], nixl_agent_config(backends=[]))
    a.create_backend("R2CCL", {"nics": "lo", "timeout": "5s"})
    assert "R2CCL" in a.backends
    b = nixl_agent("B-" + uuid.uuid4().hex[:6], nixl_agent_config(backends=[]))
    with pytest.raises(Exception):  # from the environment alone: no such NIC
        b.create_backend("R2CCL", {})
    assert "no-such-nic" in capfd.readouterr().err
