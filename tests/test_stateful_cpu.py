"""A layer run twice (a recompute) against a KV cache (issue 48): :mod:`offload.forwards.stateful`.

The recompute must run against the cache as the forward found it, and leave it holding exactly
the objects the forward left (bitwise and by identity); a cache written in place is refused in
the forward, with the layer, the argument and the fix named. Fake caches here (no transformers):
one that grows by concatenation as transformers' ``DynamicCache`` does, one that writes into
preallocated tensors as its ``StaticCache`` does.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

from offload.forwards.recompute import checkpoint_call
from offload.forwards.stateful import (
    StatefulArgumentError, StateSnapshot, is_stateful, refuse_stateful_compiled, stateful_arguments,
)
from offload.tiling.tokenwise import TiledForward


class GrowingLayer:
    """One layer's entry, grown by concatenation (a new tensor each update, as DynamicLayer)."""

    def __init__(self) -> None:
        self.keys: Optional[torch.Tensor] = None

    def update(self, k: torch.Tensor) -> torch.Tensor:
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=1)
        return self.keys


class GrowingCache:
    """A fake DynamicCache: per-layer entries added on first use, each grown by concatenation."""

    def __init__(self) -> None:
        self.layers: list[GrowingLayer] = []
        self.updates = 0

    def update(self, k: torch.Tensor, index: int) -> torch.Tensor:
        while len(self.layers) <= index:
            self.layers.append(GrowingLayer())
        self.updates += 1
        return self.layers[index].update(k)

    def get_seq_length(self) -> int:
        return 0 if not self.layers or self.layers[0].keys is None else self.layers[0].keys.shape[1]


class InPlaceCache(GrowingCache):
    """A fake StaticCache: preallocated keys and a position counter, both written in place."""

    def __init__(self, length: int, width: int) -> None:
        super().__init__()
        self.store = torch.zeros(1, length, width)
        self.position = torch.zeros((), dtype=torch.long)

    def update(self, k: torch.Tensor, index: int) -> torch.Tensor:
        start = int(self.position)
        self.store[:, start:start + k.shape[1]] = k.detach()
        self.position += k.shape[1]
        return torch.cat([self.store[:, :start], k], dim=1)


class CachedAttention(torch.nn.Module):
    """Attention over the cached keys and the new ones; records the key length each run sees."""

    def __init__(self, width: int = 8, index: int = 0) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width)
        self.index = index
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor, cache: Any = None) -> torch.Tensor:
        k = self.proj(x)
        if cache is not None:
            k = cache.update(k, self.index)
        self.seen.append(k.shape[1])
        weights = torch.softmax(x @ k.transpose(1, 2), dim=-1)
        return x + weights @ k


def _state(cache: GrowingCache) -> list[Any]:
    return [cache.updates, list(cache.layers)] + [(layer, layer.keys) for layer in cache.layers]


def _same_objects(a: list[Any], b: list[Any]) -> bool:
    flat_a = [a[0]] + a[1] + [x for pair in a[2:] for x in pair]
    flat_b = [b[0]] + b[1] + [x for pair in b[2:] for x in pair]
    return len(flat_a) == len(flat_b) and all(x is y or x == y for x, y in zip(flat_a, flat_b))


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("positional", [False, True])
def test_a_recompute_runs_against_the_cache_the_forward_saw_and_leaves_what_it_left(early_stop: bool,
                                                                                     positional: bool) -> None:
    torch.manual_seed(0)
    layer = CachedAttention()
    x = torch.randn(1, 4, 8, requires_grad=True)
    # Plain: the cache holds 4 earlier keys for this layer; the reference gradients.
    prior = torch.randn(1, 4, 8)
    plain_cache = GrowingCache()
    plain_cache.update(prior, 0)
    plain = layer(x, cache=plain_cache)
    plain.sum().backward()
    want = [x.grad.clone(), layer.proj.weight.grad.clone()]
    x.grad = None
    layer.zero_grad()

    cache = GrowingCache()
    cache.update(prior, 0)
    layer.seen.clear()
    args, kwargs = ((x, cache), {}) if positional else ((x,), {"cache": cache})
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        out = checkpoint_call(layer, args, kwargs)
        after_forward = _state(cache)
        out.sum().backward(retain_graph=True)
        assert _same_objects(after_forward, _state(cache)), "the recompute left other objects in the cache"
        out.sum().backward()  # a second backward recomputes once more
    assert _same_objects(after_forward, _state(cache)), "the second recompute left other objects in the cache"
    assert layer.seen == [8, 8, 8], f"each run must see the keys the forward saw, saw {layer.seen}"
    assert cache.updates == 2 and torch.equal(cache.layers[0].keys, plain_cache.layers[0].keys)
    assert torch.equal(out, plain)
    assert torch.equal(x.grad, 2 * want[0]) and torch.equal(layer.proj.weight.grad, 2 * want[1])


def test_a_cache_created_by_the_first_run_is_left_to_it() -> None:
    # The cache's per-layer entry did not exist before the forward (transformers' lazy layers):
    # the recompute's own entry is dropped, the forward's put back.
    layer = CachedAttention()
    x = torch.randn(1, 4, 8, requires_grad=True)
    cache = GrowingCache()
    out = checkpoint_call(layer, (x,), {"cache": cache})
    entry, keys = cache.layers[0], cache.layers[0].keys
    out.sum().backward()
    assert len(cache.layers) == 1 and cache.layers[0] is entry and cache.layers[0].keys is keys


def test_a_cache_written_in_place_is_refused_in_the_forward_naming_layer_argument_and_fix() -> None:
    layer = CachedAttention()
    cache = InPlaceCache(16, 8)
    with pytest.raises(StatefulArgumentError) as caught:
        checkpoint_call(layer, (torch.randn(1, 4, 8, requires_grad=True),), {"cache": cache})
    message = str(caught.value)
    assert "CachedAttention" in message and "cache= (a InPlaceCache)" in message
    assert "use_cache=False" in message and "num_offload_layers" in message
    # Without a recompute (no checkpoint), the same call is fine: nothing runs twice.
    layer(torch.randn(1, 4, 8), cache=InPlaceCache(16, 8))


def test_snapshot_restores_lists_dicts_and_attributes_and_sees_in_place_writes() -> None:
    cache = GrowingCache()
    cache.update(torch.ones(1, 2, 3), 0)
    cache.extra = {"a": torch.zeros(2)}  # type: ignore[attr-defined]
    snapshot = StateSnapshot([("cache", cache)])
    keys, extra_a = cache.layers[0].keys, cache.extra["a"]  # type: ignore[attr-defined]
    cache.update(torch.ones(1, 2, 3), 0)
    cache.update(torch.ones(1, 2, 3), 3)
    cache.extra["b"] = 1  # type: ignore[attr-defined]
    assert snapshot.written_in_place() == []
    snapshot.restore()
    assert len(cache.layers) == 1 and cache.layers[0].keys is keys and cache.updates == 1
    assert cache.extra == {"a": extra_a}  # type: ignore[attr-defined]
    extra_a.add_(1)
    assert snapshot.written_in_place() == ["cache.extra.a"]


def test_what_counts_as_a_cache() -> None:
    assert is_stateful(GrowingCache())
    assert not any(is_stateful(v) for v in (torch.zeros(1), {"update": 1}, {}, [], (1,), None, 3, "cache"))
    assert [name for name, _ in stateful_arguments((1, GrowingCache()), {"cache": GrowingCache(), "mask": None})] \
        == ["argument 1", "cache="]
    transformers = pytest.importorskip("transformers")
    assert is_stateful(transformers.DynamicCache())


def test_a_tiled_module_called_with_a_cache_is_refused() -> None:
    layer = CachedAttention()
    tiled = TiledForward(layer, layer.forward, 2)
    with pytest.raises(StatefulArgumentError, match="not token-wise"):
        tiled(torch.randn(1, 4, 8, requires_grad=True), cache=GrowingCache())


def test_a_compiled_selective_module_with_a_cache_is_refused() -> None:
    layer = CachedAttention()
    refuse_stateful_compiled(layer.forward, (torch.zeros(1),), {"cache": None})
    with pytest.raises(StatefulArgumentError, match="CachedAttention.*use_cache=False"):
        refuse_stateful_compiled(layer.forward, (torch.zeros(1),), {"cache": GrowingCache()})
