"""r2ccl.KvEngine with CPU tensors: a prefill and a decode engine in this process, on loopback
rails of their own. Whole and layer-by-layer pushes, a pull, notifications with their payload,
every byte checked; bad input refused with an exception naming it; a closed engine refuses."""

import os

import pytest
import torch

import r2ccl

LAYERS, PARTS, BLOCKS, BLOCK_BYTES = 3, 2, 12, 128


def make(nics: str, name: str) -> r2ccl.KvEngine:
    os.environ["R2CCL_NICS"] = nics
    try:
        return r2ccl.KvEngine(name)
    finally:
        del os.environ["R2CCL_NICS"]


def at(layer: int, part: int, block: int) -> slice:
    start = ((layer * PARTS + part) * BLOCKS + block) * BLOCK_BYTES
    return slice(start, start + BLOCK_BYTES)


@pytest.fixture
def pair():
    prefill = make("127.0.34.1,127.0.34.2", "prefill")
    decode = make("127.0.34.3,127.0.34.4", "decode")
    src = torch.randint(0, 256, (LAYERS * PARTS * BLOCKS * BLOCK_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    dst = torch.zeros_like(src)
    shape = dict(layers=LAYERS, blocks=BLOCKS, block_bytes=BLOCK_BYTES, parts=PARTS)
    spool = prefill.register_pool([src], **shape)
    dpool = decode.register_pool([dst], **shape)
    peer = prefill.connect(decode.metadata())
    yield prefill, decode, src, dst, spool, dpool, peer
    prefill.close()
    decode.close()


def landed(src, dst, pairs, layers=range(LAYERS)):
    for s, d in pairs:
        for layer in layers:
            for part in range(PARTS):
                assert torch.equal(dst[at(layer, part, d)], src[at(layer, part, s)]), (s, d, layer, part)


def wait_note(engine, bounded=500):
    import time

    for _ in range(bounded):  # bounded: 5 s
        notes = engine.notifications()
        if notes:
            return notes
        time.sleep(0.01)
    pytest.fail("no notification within 5 s")


def test_push_layer_by_layer_pull_and_notifications(pair):
    prefill, decode, src, dst, spool, dpool, peer = pair
    prefill.submit(1, peer, spool, dpool, [r2ccl.Span(0, LAYERS, [1, 2, 5], [3, 4, 0])], payload=b"token 42")
    assert prefill.wait(1, timeout=10) == "done"
    assert prefill.poll(1) == "done"
    landed(src, dst, [(1, 3), (2, 4), (5, 0)])
    (note,) = wait_note(decode)
    assert (note.request, note.state, note.payload, note.invalid_blocks) == (1, "done", b"token 42", [])
    assert note.invalid_block_count == 0

    prefill.begin(2, peer, spool, dpool)
    for layer in range(LAYERS):
        prefill.add(2, (layer, layer + 1, [6], [7]))
    prefill.seal(2)
    assert prefill.wait(2, timeout=10) == "done"
    landed(src, dst, [(6, 7)])
    landed(src, dst, [(1, 3), (2, 4), (5, 0)])

    back = decode.connect(prefill.metadata())
    decode.pull(3, back, dpool, spool, [(0, LAYERS, [8, 9], [10, 11])])
    assert decode.wait(3, timeout=10) == "done"
    landed(src, dst, [(8, 10), (9, 11)])


def test_the_invalid_blocks_of_a_cancelled_push_are_listed_on_both_sides(pair):
    prefill, decode, src, dst, spool, dpool, peer = pair
    prefill.begin(4, peer, spool, dpool)
    prefill.add(4, (0, LAYERS, [1, 2, 3], [9, 5, 7]))
    prefill.cancel(4)
    assert prefill.wait(4, timeout=10) == "cancelled"
    assert prefill.invalid_blocks(4) == [5, 7, 9]
    (note,) = wait_note(decode)
    assert (note.request, note.state, note.invalid_blocks) == (4, "cancelled", [5, 7, 9])
    assert note.invalid_block_count == 3
    prefill.submit(5, peer, spool, dpool, [(0, LAYERS, [1], [9])])
    assert prefill.wait(5, timeout=10) == "done"
    assert prefill.invalid_blocks(5) == []
    with pytest.raises(r2ccl.R2cclError, match="no request 1234"):
        prefill.invalid_blocks(1234)


def test_bad_input_is_refused_naming_it(pair):
    prefill, decode, src, dst, spool, dpool, peer = pair
    with pytest.raises(r2ccl.R2cclError, match="source block 99 is out of range"):
        prefill.submit(5, peer, spool, dpool, [(0, LAYERS, [99], [0])])
    with pytest.raises(ValueError, match="span 0 has 2 source blocks and 1 destination blocks"):
        prefill.submit(5, peer, spool, dpool, [(0, LAYERS, [1, 2], [0])])
    with pytest.raises(r2ccl.R2cclError, match=r"a payload of 4097 bytes \(at most 4096\)"):
        prefill.submit(5, peer, spool, dpool, [(0, LAYERS, [1], [0])], payload=bytes(4097))
    with pytest.raises(r2ccl.R2cclError, match="no request 1234"):
        prefill.poll(1234)
    with pytest.raises(ValueError, match=r"buffers\[0\] is not contiguous"):
        prefill.register_pool([torch.zeros(8, 8, dtype=torch.uint8).t()], layers=1, blocks=1, block_bytes=8, parts=1)
    with pytest.raises(ValueError, match=r"buffers\[0\] is on meta"):
        prefill.register_pool([torch.zeros(64, dtype=torch.uint8, device="meta")], layers=1, blocks=1, block_bytes=8, parts=1)
    with pytest.raises(TypeError, match="metadata must be bytes"):
        prefill.connect("not bytes")
    with pytest.raises(r2ccl.R2cclError, match="KvLoadRemote failed"):
        prefill.connect(b"\x00" * 40)
    # Still usable.
    prefill.submit(6, peer, spool, dpool, [(0, LAYERS, [11], [1])])
    assert prefill.wait(6, timeout=10) == "done"
    landed(src, dst, [(11, 1)])
    with pytest.raises(r2ccl.R2cclError, match="already ended"):
        prefill.cancel(6)
    prefill.unregister_pool(spool)
    with pytest.raises(r2ccl.R2cclError, match="pool"):
        prefill.submit(7, peer, spool, dpool, [(0, LAYERS, [1], [0])])


def test_a_closed_engine_refuses():
    e = make("127.0.34.5", "alone")
    e.close()
    with pytest.raises(r2ccl.R2cclError, match="the KV engine is closed"):
        e.metadata()
    e.close()
