import pytest
import torch

from vlm_kv.storage.store import VarlenKVStore


def _store(b=2, h=3, d=4):
    return VarlenKVStore(b, h, d, torch.float32, torch.device("cpu"), state_names=("s",))


def _append(store, start, q, valid=None):
    b, h, d = store.batch_size, store.num_kv_heads, store.head_dim
    pos = torch.arange(start, start + q)
    # key value encodes (batch, head, position) so we can check what survives
    k = (torch.arange(b)[:, None, None, None] * 1000 + torch.arange(h)[None, :, None, None] * 100
         + pos[None, None, :, None]).float().expand(b, h, q, d).clone()
    mod = torch.zeros(b, q, dtype=torch.uint8)
    mod[:, : q // 2] = 1
    store.append(k, -k, pos, mod, valid if valid is not None else torch.ones(b, q, dtype=torch.bool))


def test_padded_view_round_trip_and_compaction_frees_memory():
    store = _store()
    _append(store, 0, 10)
    full_bytes = store.kv_bytes()
    view = store.padded_view(states=("s",))
    assert view.keys.shape == (2, 3, 10, 4) and bool(view.valid.all())
    # keep different numbers per head: head h keeps positions < 3 + h
    keep = view.positions < (3 + torch.arange(3)).view(1, 3, 1)
    store.compact(keep, view)
    assert store.tail_size == 0
    assert store.head_lengths().tolist() == [[3, 4, 5], [3, 4, 5]]
    assert store.kv_bytes() == full_bytes * 24 // 60  # 24 of 60 entries stored, nothing masked in place
    assert store.body_keys.shape[0] == 24
    # new tokens land after each head's kept entries, original positions preserved
    _append(store, 10, 2)
    v = store.padded_view()
    for b in range(2):
        for h in range(3):
            n = 3 + h
            pos = v.positions[b, h, : n + 2].tolist()
            assert pos == list(range(n)) + [10, 11]
            assert torch.equal(v.keys[b, h, : n + 2, 0], torch.tensor([b * 1000 + h * 100 + p for p in pos]).float())
            assert not bool(v.valid[b, h, n + 2 :].any())
            assert torch.equal(v.values[b, h, : n + 2], -v.keys[b, h, : n + 2])


def test_padding_entries_are_dropped_and_state_follows_entries():
    store = _store(b=2, h=1)
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[1, :2] = False  # left padding in row 1
    _append(store, 0, 6, valid)
    view = store.padded_view(states=("s",))
    store.add_state("s", view.positions.float())
    store.compact(torch.ones_like(view.valid))
    assert store.head_lengths().tolist() == [[6], [4]]
    v = store.padded_view(states=("s",))
    assert v.positions[1, 0, :4].tolist() == [2, 3, 4, 5]
    assert torch.equal(v.state["s"][1, 0, :4], torch.tensor([2.0, 3, 4, 5]))
    counts = store.modality_counts().tolist()
    assert counts == [3 + 3, 3 + 1, 0]  # modality 1 marks the first half of each row


def test_add_state_accumulates_on_body_and_tail():
    store = _store(b=1, h=2)
    _append(store, 0, 4)
    store.compact(store.padded_view(states=("s",)).positions < 2)
    _append(store, 4, 3)
    v = store.padded_view(states=("s",))
    store.add_state("s", torch.ones_like(v.state["s"]))
    store.add_state("s", torch.ones_like(v.state["s"]))
    v = store.padded_view(states=("s",))
    assert torch.equal(v.state["s"][v.valid], torch.full((10,), 2.0))


def _snapshot(store):
    view = store.padded_view(states=("s",))
    return [view.keys, view.values, view.positions, view.modality, view.valid, view.state["s"], store.lengths]


def test_uniform_rows_keeping_equal_counts_compact_like_the_general_path(monkeypatch):
    def build():
        store = _store()
        _append(store, 0, 12)
        store.compact(store.padded_view().positions % 2 == 0)  # 6 per row: a uniform body
        _append(store, 12, 5)  # body then tail
        store.add_state("s", torch.arange(2 * 3 * 11, dtype=torch.float32).view(2, 3, 11))
        return store

    gen = torch.Generator().manual_seed(0)
    keep = torch.rand(6, 11, generator=gen).argsort(dim=1) < 4  # 4 of 11 per row, different columns
    fast = build()
    assert fast.uniform and fast._compact_rows_alike(keep.clone()) is True
    monkeypatch.setattr(type(fast), "_compact_rows_alike", lambda self, keep: False)
    general = build()
    general.compact(keep.view(2, 3, 11))
    for a, b in zip(_snapshot(fast), _snapshot(general)):
        assert torch.equal(a, b)
    assert fast.uniform and fast.tail_size == 0 and fast.kv_bytes() == general.kv_bytes()


def _entry_source_matches_padded_view(store):
    view = store.padded_view(states=("s",))
    b, h, col = torch.nonzero(view.valid, as_tuple=True)
    keys, values = store.entry_source().read(b, h, col)
    assert torch.equal(keys, view.keys[b, h, col]) and torch.equal(values, view.values[b, h, col])
    bare = store.padded_view(with_values=False, with_keys=False, states=("s",))
    assert bare.keys.shape == view.keys.shape[:3] + (0,) and bare.values.shape[-1] == 0
    for name in ("positions", "modality", "valid"):
        assert torch.equal(getattr(bare, name), getattr(view, name))
    assert torch.equal(bare.state["s"], view.state["s"])


def test_entry_source_reads_what_the_padded_view_lays_out():
    """Tail only, a uniform body and tail, ragged rows with a tail, ragged rows alone."""
    store = _store()
    _append(store, 0, 6)
    _entry_source_matches_padded_view(store)
    view = store.padded_view()
    store.compact(view.positions < 4)  # every row keeps 4: uniform
    _append(store, 6, 3)
    assert store.uniform
    _entry_source_matches_padded_view(store)
    view = store.padded_view()
    store.compact(view.positions < (1 + torch.arange(3)).view(1, 3, 1))  # rows keep 1, 2, 3
    assert not store.uniform
    _entry_source_matches_padded_view(store)
    _append(store, 9, 2)
    _entry_source_matches_padded_view(store)


def test_entry_source_keeps_reading_the_entries_of_its_moment():
    store = _store()
    _append(store, 0, 6)
    source = store.entry_source()
    view = store.padded_view()
    b, h, col = torch.nonzero(view.valid, as_tuple=True)
    store.compact(view.positions < 2)
    keys, _ = source.read(b, h, col)
    assert torch.equal(keys, view.keys[b, h, col])


def test_a_padded_view_without_keys_has_no_values():
    with pytest.raises(ValueError, match="without keys"):
        _store().padded_view(with_keys=False)
