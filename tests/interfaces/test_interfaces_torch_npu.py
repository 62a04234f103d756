"""Drop-in: the Python examples of torch_npu.npu_incre_flash_attention.md run on `import fia as torch_npu`.

Each example is the document's code with `.npu()` removed; the graph-mode example uses the stock
torch.compile backend instead of torchair (whose imports, logger and config lines are dropped).
"""
import math

import pytest
import torch

import naive
from util import assert_close

pytestmark = pytest.mark.backend_independent      # one run with automatic backend selection (conftest)


def _reference(q, k, v, n, scale, mask=None):
    """naive attention on BSH tensors (SPEC 15.1: fully masked rows give the mean of V)."""
    b, _, h = q.shape
    d = h // n
    c = lambda x: x.reshape(b, x.shape[1], n, d).permute(0, 2, 1, 3)  # noqa: E731
    m = None if mask is None else mask.reshape(b, 1, -1)              # [B, Sq = 1, Skv]
    out, _ = naive.attention(c(q), c(k), c(v), scale=scale, mask=m)
    return out.permute(0, 2, 1, 3).reshape(b, 1, h)


@pytest.mark.parametrize("module", ["fia", "fia.torch_npu"])
def test_doc_single_op_example(module):
    import importlib
    torch_npu = importlib.import_module(module)
    torch.manual_seed(0)
    # ---- the document's example (单算子调用), .npu() removed
    q = torch.randn(2, 1, 40 * 128, dtype=torch.float16)
    k = torch.randn(2, 1, 40 * 128, dtype=torch.float16)
    v = torch.randn(2, 1, 40 * 128, dtype=torch.float16)
    scale = 1/math.sqrt(128.0)

    # 调用IFA算子
    out = torch_npu.npu_incre_flash_attention(q, k, v, num_heads=40, input_layout="BSH", scale_value=scale)
    out  # noqa: B018
    # ----
    assert out.shape == (2, 1, 5120) and out.dtype == torch.float16
    assert torch.equal(out, v)          # one key per batch: the output is that key's value
    assert_close(out, _reference(q, k, v, 40, scale), torch.float16)


def _graph_example():
    # ---- the document's example (图模式调用): torchair lines dropped, .npu() removed, stock backend
    import torch
    import fia as torch_npu
    import math

    import torch._dynamo
    TORCHDYNAMO_VERBOSE=1  # noqa: F841
    TORCH_LOGS="+dynamo"  # noqa: F841

    # 数据生成
    q = torch.randn(2, 1, 40 * 128, dtype=torch.float16)
    k = torch.randn(2, 2048, 40 * 128, dtype=torch.float16)
    v = torch.randn(2, 2048, 40 * 128, dtype=torch.float16)
    atten = torch.randn(2, 1, 1, 2048).bool()
    scale_value = 1/math.sqrt(128.0)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()

        def forward(self):
            return torch_npu.npu_incre_flash_attention(q, k, v, num_heads=40, input_layout="BSH", scale_value=scale_value, atten_mask=atten)

    def MetaInfershape():
        with torch.no_grad():
            model = Model()
            model = torch.compile(model, dynamic=False, fullgraph=True)
            graph_output = model()

        single_op = torch_npu.npu_incre_flash_attention(q, k, v, num_heads=40, input_layout="BSH", scale_value=scale_value, atten_mask=atten)
        print("single op output with mask:", single_op, single_op.shape)
        print("graph output with mask:", graph_output, graph_output.shape)
        return single_op, graph_output

    # ----
    return MetaInfershape(), (q, k, v, atten, scale_value)


def test_doc_graph_mode_example_runs(capsys):
    torch.manual_seed(1)
    torch._dynamo.reset()
    (single_op, graph_output), (q, k, v, atten, scale) = _graph_example()
    printed = capsys.readouterr().out
    assert "single op output with mask:" in printed and "torch.Size([2, 1, 5120])" in printed
    assert graph_output.shape == single_op.shape == (2, 1, 5120)
    assert torch.equal(graph_output, single_op)
    # randn(...).bool() masks almost every key; inner_precise defaults to 1: the kept keys decide the rows
    assert_close(single_op, _reference(q, k, v, 40, scale, atten), torch.float16)
