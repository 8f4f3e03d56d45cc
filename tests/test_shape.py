"""ModelShape from the real test models' headers."""

from localllm.modelstore.gguf_header import read_header
from localllm.modelstore.shape import FULL, SLIDING, read_shape


def test_smollm2_shape(smollm2_gguf):
    shape = read_shape(smollm2_gguf)
    assert (shape.architecture, shape.file_type, shape.n_layer) == ("llama", "Q4_1", 30)
    assert shape.context_length == 8192
    assert shape.chat_template and "<|im_start|>" in shape.chat_template
    assert shape.tied_embeddings
    assert all(layer.kind == FULL and layer.n_head_kv == 3 for layer in shape.layers)
    # 30 layers x 3 KV heads x (64 + 64) dims x 2 bytes (f16)
    assert shape.kv_bytes_per_token(2, 2) == 30 * 3 * 128 * 2
    assert shape.size_label == "135M"
    # Tensors and the header's data offset account for the file, minus alignment padding.
    header = read_header(smollm2_gguf)
    assert 0 <= shape.file_size - header.data_offset - shape.weight_bytes < 32 * len(shape.tensors)


def test_gemma3_sliding_window_layers(gemma_gguf):
    shape = read_shape(gemma_gguf)
    assert shape.architecture == "gemma3"
    assert shape.chat_template is None
    assert shape.sliding_window == 512
    kinds = [layer.kind for layer in shape.layers]
    # llama.cpp's gemma3 pattern: five sliding layers, then one global, repeated.
    assert kinds[:6] == [SLIDING] * 5 + [FULL]
    assert kinds.count(FULL) == 3 and len(kinds) == 18
