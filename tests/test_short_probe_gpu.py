"""The short probe is invisible on the GPU too (issue 49): the CPU test's watched model (an
optimizer in backward, parameter, accumulator and module hooks, a caller-side graph, a leaf
``inputs_embeds``) under the default budget ("device"), every observable, the CUDA random state
included, bit for bit the plain step's."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("transformers")

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from offload.layers import model_form  # noqa: E402
from test_short_probe_cpu import CUT, assert_same, run_watched  # noqa: E402


@pytest.mark.parametrize("how", ["ids", "caller_graph", "leaf"])
def test_the_short_probe_changes_nothing_the_user_can_observe_on_cuda(how: str, monkeypatch,
                                                                       repeatable_attention) -> None:
    monkeypatch.setattr(model_form, "SHORT_PROBE_TOKENS", 16)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        ctx, steps = run_watched(how, forward_hook=False, steps=3, device="cuda")
    assert ctx._planned.profile.shape == CUT, "the first batch was not probed short"
    for i, (want, got, plain, probed) in enumerate(steps):
        assert torch.equal(want, got), f"step {i}: loss {got} against plain {want}"
        assert_same(plain, probed, f"step {i}")
