"""Terra's LFQ image tokenizer: bit/index round trips, the released architecture's shape and size,
encode -> quantize -> decode, strict checkpoint round trips, and `terra tokenize` end to end."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from terra_cli.models.checkpoint import CheckpointError
from tokenizer_decoder import (
    TERRA_TOKENIZER_CONFIG,
    ImageTokenizer,
    TokenizerConfig,
    build_model,
    codes_to_indices,
    depth_to_space,
    indices_to_bits,
    indices_to_codes,
    small_config,
)

from conftest import invoke_terra

SMALL_SIZE = (64, 128)  # 4 x 8 latent grid: fast on CPU


@pytest.fixture(scope="module")
def small_tok():
    return ImageTokenizer.from_config(small_config(), seed=0, device="cpu", batch_size=2, image_size=SMALL_SIZE)


@pytest.fixture(scope="module")
def saved_small_tokenizer(tmp_path_factory):
    """A small random tokenizer saved in the released layout (full 288x512 frames -> 576 tokens)."""
    directory = tmp_path_factory.mktemp("small_tokenizer")
    ImageTokenizer.from_config(small_config(), seed=1, device="cpu").save_pretrained(directory)
    return directory


def random_frames(n, h=72, w=100, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    return [np.roll(base, 7 * i, axis=1) for i in range(n)]


# -- LFQ bits <-> indices ----------------------------------------------------------------------
def test_lfq_index_bits_round_trip_edges_and_random():
    bits = 18
    rng = np.random.default_rng(0)
    indices = torch.tensor([0, 1, 2, 2**17, 2**18 - 2, 2**18 - 1, *rng.integers(0, 2**18, 64)])
    codes = indices_to_codes(indices, bits)
    assert codes.shape == (len(indices), bits)
    assert set(codes.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(codes_to_indices(codes, dim=-1), indices)
    assert torch.equal(indices_to_codes(torch.tensor(0), bits), -torch.ones(bits))
    assert torch.equal(indices_to_codes(torch.tensor(2**18 - 1), bits), torch.ones(bits))
    # channel 0 is the least significant bit
    one_hot = indices_to_bits(torch.tensor([1, 2, 2**17]), bits)
    assert one_hot[0, 0] and one_hot[0].sum() == 1
    assert one_hot[1, 1] and one_hot[1].sum() == 1
    assert one_hot[2, 17] and one_hot[2].sum() == 1


def test_sign_quantization_matches_index_formula():
    model = build_model(TokenizerConfig(ch=32, z_channels=18, num_res_blocks=1), "meta")
    z = torch.randn(3, 18, 5, 7, generator=torch.Generator().manual_seed(0))
    z[0, :, 0, 0] = 0.0  # exactly zero counts as a 0 bit (-1 code)
    codes, indices = model.quantize(z)
    assert codes.shape == z.shape and torch.equal(codes, torch.where(z > 0, 1.0, -1.0))
    weights = 2 ** np.arange(18)
    expected = ((z.numpy() > 0).astype(np.int64) * weights[None, :, None, None]).sum(1).reshape(3, -1)
    assert indices.dtype == torch.int64 and torch.equal(indices, torch.from_numpy(expected))
    assert indices[0, 0] == 0
    # tokens are row-major over the latent grid and decode back to the same codes
    assert torch.equal(model.quantize.indices_to_latent(indices, (5, 7)), codes)


def test_depth_to_space_is_dcr_order():
    x = torch.arange(2 * 8 * 3 * 5, dtype=torch.float32).reshape(2, 8, 3, 5)
    y = depth_to_space(x, 2)
    assert y.shape == (2, 2, 6, 10)
    c_out = 2
    for i in range(2):
        for j in range(2):
            for c in range(c_out):
                assert torch.equal(y[:, c, i::2, j::2], x[:, (2 * i + j) * c_out + c])


# -- the released architecture -----------------------------------------------------------------
def test_terra_config_shapes_and_parameter_count():
    model = build_model(TERRA_TOKENIZER_CONFIG, "meta")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"Terra lfq_tokenizer_B_256 architecture: {n_params:,} parameters ({n_params * 4 / 1e6:.0f} MB float32)")
    assert 60e6 < n_params < 70e6  # the released checkpoints hold ~65M float32 parameters
    frame = torch.empty(1, 3, 288, 512, device="meta")
    z = model.encoder(frame)
    assert z.shape == (1, 18, 18, 32)
    codes, indices = model.quantize(z)
    assert indices.shape == (1, 576)
    assert model.decoder(codes).shape == (1, 3, 288, 512)
    keys = set(model.state_dict())
    for name in [
        "encoder.conv_in.weight", "encoder.down.0.block.0.norm1.weight", "encoder.down.0.block.1.conv2.weight",
        "encoder.down.1.block.0.conv1.weight", "encoder.down.2.block.0.nin_shortcut.weight", "encoder.down.3.downsample.bias", "encoder.mid_block.1.norm2.bias",
        "encoder.norm_out.weight", "encoder.conv_out.bias", "decoder.conv_in.bias", "decoder.mid_block.0.conv1.weight",
        "decoder.adaptive.4.gamma.weight", "decoder.adaptive.0.beta.bias", "decoder.up.4.upsample.conv1.weight",
        "decoder.up.3.block.0.nin_shortcut.weight", "decoder.norm_out.bias", "decoder.conv_out.weight",
    ]:
        assert name in keys, name
    assert "encoder.down.4.downsample.weight" not in keys and "decoder.up.0.upsample.conv1.weight" not in keys
    assert not any(k.startswith("quantize.") for k in keys)
    assert not any(k.startswith("decoder.adaptive.") and ".gn." in k for k in keys)
    assert model.decoder.adaptive[4].gamma.weight.shape == (512, 18)
    assert model.decoder.up[1].upsample.conv1.weight.shape == (512, 128, 3, 3)


def test_config_reads_released_and_open_magvit2_layouts():
    dd = {"double_z": False, "z_channels": 18, "resolution": 256, "in_channels": 3, "out_ch": 3,
          "ch": 128, "ch_mult": [1, 1, 2, 2, 4], "num_res_blocks": 2}
    hf = TokenizerConfig.from_dict({"model_type": "x", "encoder_decoder_config": dd, "n_embed": 2**18, "embed_dim": 18})
    yaml_like = TokenizerConfig.from_dict({"model": {"init_args": {"ddconfig": dd, "n_embed": 2**18, "embed_dim": 18}}})
    flat = TokenizerConfig.from_dict(dd)
    assert hf == yaml_like == flat == TERRA_TOKENIZER_CONFIG
    assert TokenizerConfig.from_dict(hf.to_dict()) == hf
    with pytest.raises(ValueError, match="2\\*\\*z_channels"):
        TokenizerConfig.from_dict({"encoder_decoder_config": dd, "n_embed": 16384})
    with pytest.raises(ValueError, match="world-model"):
        TokenizerConfig.from_dict({"model_type": "llama_action", "hidden_size": 8})


# -- end to end on a small config --------------------------------------------------------------
def test_encode_quantize_decode_small(small_tok):
    frames = random_frames(3)
    pixels = small_tok.preprocess(frames)
    assert pixels.shape == (3, 3, *SMALL_SIZE) and pixels.dtype == torch.float32
    assert pixels.min() >= -1 and pixels.max() <= 1
    latents = small_tok.encode(pixels)
    assert latents.shape == (3, 10, 4, 8)
    codes, indices = small_tok.quantize(latents)
    assert indices.shape == (3, 32)
    out = small_tok.decode(codes)
    assert out.shape == (3, 3, *SMALL_SIZE)

    tokens = small_tok.tokenize(frames)
    assert tokens.shape == (3, small_tok.tokens_per_frame) == (3, 32) and tokens.dtype == np.int64
    assert np.array_equal(tokens, indices.numpy())
    assert 0 <= tokens.min() and tokens.max() < 2**10
    decoded = small_tok.decode_tokens(tokens)
    assert decoded.shape == (3, *SMALL_SIZE, 3) and decoded.dtype == np.uint8
    assert np.array_equal(decoded, small_tok.postprocess(out))
    # identical inputs give identical results, also across batch boundaries (batch_size 2)
    again = small_tok.tokenize([Image.fromarray(f) for f in frames] + [frames[0]])
    assert np.array_equal(again[:3], tokens) and np.array_equal(again[3], tokens[0])
    assert np.array_equal(small_tok.decode_tokens(tokens), decoded)


def test_preprocess_matches_terra_generator(small_tok):
    frame = random_frames(1, 50, 90)[0]
    expected = Image.fromarray(frame).convert("RGB").resize((SMALL_SIZE[1], SMALL_SIZE[0]))
    expected = (np.asarray(expected) / 127.5 - 1.0).astype(np.float32).transpose(2, 0, 1)
    assert np.array_equal(small_tok.preprocess([frame])[0].numpy(), expected)
    pixels = torch.tensor([[[[-2.0, -1.0], [0.0, 1.5]]]]).expand(1, 3, 2, 2)
    assert small_tok.postprocess(pixels)[0, :, :, 0].tolist() == [[0, 0], [127, 255]]


def test_postprocess_gives_terra_generators_bytes_for_every_value(small_tok):
    """The device-side uint8 conversion equals Terra's host formula, (255 * ((x + 1) / 2)).astype(uint8)
    after clamping, for float32 and bfloat16 decoder outputs, at and around every level's edge."""
    rng = np.random.default_rng(0)
    edges = np.arange(256, dtype=np.float64) / 127.5 - 1.0
    values = np.concatenate([rng.uniform(-1.5, 1.5, 40_000), edges, np.nextafter(edges, 2), np.nextafter(edges, -2)])
    for dtype in (torch.float32, torch.bfloat16):
        pixels = torch.from_numpy(values.astype(np.float32)).to(dtype).reshape(1, 1, 1, -1).expand(2, 3, 1, -1)
        x = np.clip(pixels.float().numpy(), -1.0, 1.0)
        expected = (255 * ((x + 1.0) / 2.0)).astype(np.uint8).transpose(0, 2, 3, 1)
        got = small_tok.postprocess(pixels)
        assert got.dtype == np.uint8 and got.flags.c_contiguous and np.array_equal(got, expected), dtype


def test_lagged_host_copies_hand_a_batch_over_once_the_next_is_queued_and_all_at_finish():
    """decode_tokens on CUDA (tokenizer_decoder/host_copies.py): the host waits for a batch's copy only
    after the next batch is queued behind it, so the device never idles while the host takes frames out;
    the batches arrive in order, each whole, and `finish` hands over the rest. The device's parts are
    stand-ins here (CI has no GPU); tests/test_tokenizer.py's gpu test runs the real ones."""
    from tokenizer_decoder.host_copies import LaggedHostCopies

    log = []

    class Event:
        def __init__(self, number):
            self.number = number

        def synchronize(self):
            log.append(("wait", self.number))

    class OnStandInDevice(LaggedHostCopies):
        queued = 0

        def _pinned_like(self, pixels):
            return torch.empty_like(pixels)

        def _recorded_event(self):
            self.queued += 1
            log.append(("queued", self.queued))
            return Event(self.queued)

    copies = OnStandInDevice(torch.device("cuda"))
    for number in (1, 2, 3):
        copies.put(torch.full((2, 3), number, dtype=torch.uint8),
                   lambda host: log.append(("got", host.tolist())))
    assert log == [("queued", 1), ("queued", 2), ("wait", 1), ("got", [[1] * 3] * 2),
                   ("queued", 3), ("wait", 2), ("got", [[2] * 3] * 2)]
    copies.finish()
    assert log[-2:] == [("wait", 3), ("got", [[3] * 3] * 2)] and not copies.pending


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_tokens_on_cuda_gives_the_bytes_of_each_batch_decoded_alone():
    """The lagged copies and the codes made on the device change no byte: every frame equals its
    batch decoded and brought to the host on its own, padded batches, progress and all."""
    tok = ImageTokenizer.from_config(small_config(), seed=0, device="cuda", batch_size=4, image_size=SMALL_SIZE)
    tokens = np.random.default_rng(0).integers(0, tok.codebook_size, size=(11, tok.tokens_per_frame))
    counts = []
    frames = tok.decode_tokens(tokens, full_batches=True, on_batch=counts.append)
    for start in range(0, 11, 4):
        rows = torch.from_numpy(tokens[start:start + 4])
        padded = torch.cat([rows, rows[-1:].expand(4 - len(rows), -1)]) if len(rows) < 4 else rows
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
            pixels = tok.model.decode(tok.tokens_to_codes(padded).cuda())
        assert np.array_equal(frames[start:start + 4], tok.postprocess(pixels[:len(rows)])), start
    assert counts == [4, 4, 3]


def test_decode_tokens_rejects_bad_tokens(small_tok):
    from tokenizer_decoder import TokenizerInputError

    with pytest.raises(TokenizerInputError, match="shape"):
        small_tok.decode_tokens(np.zeros((2, 31), dtype=np.int64))
    with pytest.raises(TokenizerInputError, match="lie in"):
        small_tok.decode_tokens(np.full((1, 32), 2**10, dtype=np.int64))
    with pytest.raises(TokenizerInputError, match="integers"):
        small_tok.decode_tokens(np.zeros((1, 32), dtype=np.float32))


# -- checkpoints -------------------------------------------------------------------------------
def test_save_and_reload_strict_bit_identical(tmp_path):
    tok = ImageTokenizer.from_config(small_config(), seed=3, device="cpu", image_size=SMALL_SIZE)
    tok.save_pretrained(tmp_path / "tok")
    config = json.loads((tmp_path / "tok" / "config.json").read_text())
    assert config["encoder_decoder_config"]["z_channels"] == 10 and config["n_embed"] == 1024
    loaded = ImageTokenizer.from_pretrained(tmp_path / "tok", device="cpu", image_size=SMALL_SIZE)
    for key, value in tok.model.state_dict().items():
        assert torch.equal(value, loaded.model.state_dict()[key]), key
    frames = random_frames(2, seed=5)
    assert np.array_equal(tok.tokenize(frames), loaded.tokenize(frames))
    tokens = tok.tokenize(frames)
    assert np.array_equal(tok.decode_tokens(tokens), loaded.decode_tokens(tokens))


def test_renamed_key_fails_naming_it(tmp_path):
    ImageTokenizer.from_config(small_config(), device="cpu").save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["decoder.adaptive.0.scale.weight"] = state.pop("decoder.adaptive.0.gamma.weight")
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        ImageTokenizer.from_pretrained(tmp_path, device="cpu")
    message = str(err.value)
    assert "decoder.adaptive.0.gamma.weight" in message and "decoder.adaptive.0.scale.weight" in message
    assert "\n" not in message


def test_mismatched_config_and_quantize_buffers(tmp_path):
    ImageTokenizer.from_config(small_config(), device="cpu").save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    # buffers a port may have saved are accepted when they hold what they must ...
    state["quantize.mask"] = 2 ** torch.arange(10)
    state["quantize.zero"] = torch.tensor(0.0)
    save_file(state, tmp_path / "model.safetensors")
    ImageTokenizer.from_pretrained(tmp_path, device="cpu")
    # ... and refused in the other bit order
    state["quantize.mask"] = 2 ** torch.arange(9, -1, -1)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="most-significant-bit first"):
        ImageTokenizer.from_pretrained(tmp_path, device="cpu")
    # a config whose widths differ from the weights names the mis-shaped keys
    state.pop("quantize.mask")
    save_file(state, tmp_path / "model.safetensors")
    small_config(ch=64).save(tmp_path)
    with pytest.raises(CheckpointError, match="shape mismatch"):
        ImageTokenizer.from_pretrained(tmp_path, device="cpu")


# -- the CLI -----------------------------------------------------------------------------------
def test_cli_tokenize_and_reconstruct(tmp_path, saved_small_tokenizer):
    folder = tmp_path / "frames"
    folder.mkdir()
    for i, frame in zip([1, 2, 10], random_frames(3, 90, 160)):
        Image.fromarray(frame).save(folder / f"frame{i}.png")
    result = invoke_terra("tokenize", folder, "--out", tmp_path / "tokens.npy", "--tokenizer", saved_small_tokenizer,
                       "--reconstruct", tmp_path / "recon", "--device", "cpu", "--batch-size", 2)
    assert result.returncode == 0, result.stderr
    tokens = np.load(tmp_path / "tokens.npy")
    assert tokens.shape == (3, 576) and tokens.dtype == np.int64
    written = sorted(p.name for p in (tmp_path / "recon").iterdir())
    assert written == [".terra-made.json", "frame_0000.png", "frame_0001.png", "frame_0002.png"]  # + which terra made
    assert np.asarray(Image.open(tmp_path / "recon" / "frame_0002.png")).shape == (288, 512, 3)
    assert "PSNR" in result.stdout and "mean" in result.stdout
    # natural frame order: the last row is frame10.png
    tok = ImageTokenizer.from_pretrained(saved_small_tokenizer, device="cpu")
    assert np.array_equal(tok.tokenize([Image.open(folder / "frame10.png")])[0], tokens[2])


def test_cli_tokenize_errors(tmp_path, saved_small_tokenizer):
    (tmp_path / "empty").mkdir()
    result = invoke_terra("tokenize", tmp_path / "empty", "--out", tmp_path / "t.npy", "--tokenizer", saved_small_tokenizer)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "has no images" in lines[0]
    assert not (tmp_path / "t.npy").exists()

    Image.fromarray(random_frames(1)[0]).save(tmp_path / "ok.png")
    broken = tmp_path / "broken_tok"
    broken.mkdir()
    (broken / "config.json").write_text((saved_small_tokenizer / "config.json").read_text())
    state = load_file(saved_small_tokenizer / "model.safetensors")
    state.pop("encoder.conv_in.weight")
    save_file(state, broken / "model.safetensors")
    result = invoke_terra("tokenize", tmp_path / "ok.png", "--out", tmp_path / "t.npy", "--tokenizer", broken)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "missing keys: encoder.conv_in.weight" in result.stderr


def test_full_batches_take_the_compiled_decoder_and_fall_back_to_eager_when_it_fails(monkeypatch):
    """`compile_decoder` sets a decoder for full batches only (static shapes); on the CPU it sets
    none. A compiled decoder that fails is dropped for the eager one, with the reason kept."""
    from terra_cli.scenarios import frame_store

    tok = ImageTokenizer.from_config(small_config(), seed=0, device="cpu", batch_size=2, image_size=SMALL_SIZE)
    tokens = np.random.default_rng(0).integers(0, tok.codebook_size, size=(3, tok.tokens_per_frame))
    eager = tok.decode_tokens(tokens, full_batches=True)
    assert tok.compile_decoder() is False and tok._compiled_decode is None
    assert frame_store.compile_decoder(tok) is False  # a CPU decoder stays eager

    batches = []

    def stand_in(codes):
        batches.append(codes.shape[0])
        return tok.model.decode(codes)

    tok._compiled_decode = stand_in
    np.testing.assert_array_equal(tok.decode_tokens(tokens, full_batches=True), eager)
    assert batches == [2, 2]  # the short last batch was padded to the batch size
    tok.decode_tokens(tokens)  # not full batches: the eager decoder
    assert batches == [2, 2]
    counted = []
    one_at_a_time = ImageTokenizer.from_config(small_config(), seed=0, device="cpu", batch_size=1, image_size=SMALL_SIZE)
    np.testing.assert_array_equal(tok.decode_tokens(tokens, full_batches=True, batch_size=1, on_batch=counted.append),
                                  one_at_a_time.decode_tokens(tokens))
    assert batches == [2, 2, 1, 1, 1] and counted == [1, 1, 1]  # a call's own batch size (a server's pictures)
    with pytest.raises(ValueError, match="batch size must be at least 1, got 0"):
        tok.decode_tokens(tokens, batch_size=0)
    del batches[2:]

    def broken(codes):
        raise RuntimeError("no Triton here\nmore")

    tok._compiled_decode = broken
    np.testing.assert_array_equal(tok.decode_tokens(tokens, full_batches=True), eager)
    assert tok.decoder_compile_error == "RuntimeError: no Triton here"


def test_a_frames_tokens_come_from_a_full_batch_where_kernels_depend_on_the_shape(monkeypatch):
    """On CUDA (`full_encode_batches`, on by default there) a last, shorter batch is encoded padded
    to the batch size, so a frame's tokens do not depend on how many frames were tokenized with it;
    the padding never reaches the output. On the CPU the shorter batch stays as it is."""
    tok = ImageTokenizer.from_config(small_config(), seed=0, device="cpu", batch_size=4, image_size=SMALL_SIZE)
    assert tok.full_encode_batches is False  # the CPU's default
    frames = [np.random.default_rng(i).integers(0, 256, (*SMALL_SIZE, 3), dtype=np.uint8) for i in range(5)]
    plain = tok.tokenize(frames)

    shapes = []
    encode = tok.model.encode

    def spy(pixels):
        shapes.append(pixels.shape[0])
        return encode(pixels)

    monkeypatch.setattr(tok.model, "encode", spy)
    tok.tokenize(frames)
    assert shapes == [4, 1]
    shapes.clear()
    tok.full_encode_batches = True  # what CUDA gets
    padded = tok.tokenize(frames)
    assert shapes == [4, 4] and padded.shape == (5, tok.tokens_per_frame)
    np.testing.assert_array_equal(padded, plain)
    shapes.clear()
    np.testing.assert_array_equal(tok.tokenize(frames[4:]), plain[4:])  # one frame alone: one full batch
    assert shapes == [4]
