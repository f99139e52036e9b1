"""The one device placement (``moetailor.device``): what ``--device`` resolves to, and the bytes a
layer-streamed run places on its device: at most one layer plus one batch's activations, never
the whole model."""
import pytest
import torch

from moetailor.calibration.streaming import calibrate_streamed
from moetailor.device import Placement, module_bytes, parse_device, resolve_device, tensor_bytes
from moetailor.models.streamed import LayerStream
from moetailor.models.tiny import char_tokenizer, tiny_model


def test_device_spellings_and_auto():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    assert parse_device(" CUDA:1 ") == "cuda:1"
    with pytest.raises(ValueError, match="choose auto, cpu, cuda or cuda:N"):
        parse_device("gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU here")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_a_gpu_torch_does_not_see_is_a_one_line_error_naming_the_fix(spec):
    with pytest.raises(ValueError) as e:
        resolve_device(spec)
    assert "torch sees no GPU" in str(e.value) and "--device cpu" in str(e.value) and "\n" not in str(e.value)


def nbytes(module) -> int:
    """Bytes of a module's weights (meta tensors too: shapes and dtypes only)."""
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("placement") / "model"
    tiny_model("qwen2_moe", num_experts=8, top_k=2, layers=6, hidden=64, expert_width=32).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def test_a_streamed_run_places_one_layer_plus_one_batch_of_activations(checkpoint):
    placement = Placement.of("cpu")
    batch_tokens, seq_len = 256, 64
    stats = calibrate_streamed(checkpoint, char_tokenizer(), "tasks", 1024, batch_tokens=batch_tokens, seq_len=seq_len,
                               progress=False, placement=placement)
    stream = LayerStream(checkpoint)
    layer = max(nbytes(m) for m in [stream.model.model.embed_tokens, *stream.layers])   # the largest one placed
    whole = nbytes(stream.model)
    shape = (batch_tokens // seq_len, seq_len)
    hidden = shape[0] * shape[1] * stream.config.hidden_size * 4                    # [B, S, H] fp32
    inputs = max(tensor_bytes(stream.layer_inputs(shape, i)) for i in range(len(stream.layers)))
    assert placement.resident == 0                                                  # every layer left the device
    assert placement.peak <= layer + 2 * hidden + inputs                            # one layer + its activations
    assert placement.peak >= layer                                                  # each layer really was placed
    assert placement.peak < whole / 2                                               # never the model
    assert stats.meta["peak_device_bytes"] == placement.peak and stats.meta["device"] == "cpu"
    stream.close()


def test_an_in_memory_model_is_placed_whole():
    model = tiny_model("qwen2_moe")
    placement = Placement.of("cpu")
    assert placement.model(model) is model
    assert placement.resident == placement.peak == module_bytes(model)
