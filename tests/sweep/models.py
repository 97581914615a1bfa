"""The models of the sweep: tiny random Hugging Face configs (transformers 5.23, no downloads) and hand-written
torch norms in the styles users write them. Each builder returns ``Case(module, inputs, norms)``: the module takes
the inputs positionally and returns one tensor; ``norms`` is the number of norm computations the graph holds, or
``None`` to count the calls of norm modules with forward hooks (see ``run_sweep.count_norm_calls``)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import math  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

H, LAYERS, HEADS, FFN, VOCAB, POS = 32, 2, 4, 64, 100, 64
BATCH, SEQ = 2, 7


@dataclass
class Case:
    module: nn.Module
    inputs: tuple[torch.Tensor, ...]
    names: tuple[str, ...]
    norms: int | None = None  # None: count norm-module calls


class FirstOutput(nn.Module):
    """model(**named inputs) -> its first tensor output (last_hidden_state, or the decoder's for seq2seq)."""

    def __init__(self, model: nn.Module, names: tuple[str, ...], extra: dict | None = None) -> None:
        super().__init__()
        self.model, self.names, self.extra = model, names, extra or {}

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        kwargs = dict(zip(self.names, args))
        for key, source in self.extra.items():
            kwargs[key] = kwargs[source]
        out = self.model(**kwargs, return_dict=True)
        for key in ("last_hidden_state", "logits", "pooler_output"):
            value = out.get(key) if hasattr(out, "get") else None
            if isinstance(value, torch.Tensor):
                return value
        return out[0]


def _text(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    mask[0, -2:] = 0
    return ids, mask


def _hf(name: str, config_kwargs: dict, model_class: str | None = None) -> nn.Module:
    import transformers

    config = getattr(transformers, f"{name}Config")(**config_kwargs)
    if hasattr(config, "_attn_implementation"):
        config._attn_implementation = "eager"
    return getattr(transformers, model_class or f"{name}Model")(config)


LLM = dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
           num_key_value_heads=2, intermediate_size=FFN, max_position_embeddings=POS, head_dim=H // HEADS,
           use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ENC = dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
           intermediate_size=FFN, max_position_embeddings=POS, pad_token_id=0)
SEQ2SEQ = dict(vocab_size=VOCAB, d_model=H, encoder_layers=1, decoder_layers=1, encoder_attention_heads=HEADS,
               decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, max_position_embeddings=POS,
               use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
T5 = dict(vocab_size=VOCAB, d_model=H, d_kv=H // HEADS, d_ff=FFN, num_layers=1, num_decoder_layers=1,
          num_heads=HEADS, relative_attention_num_buckets=8, use_cache=False, decoder_start_token_id=0)


def text(name: str, config: dict, model_class: str | None = None, seq2seq: bool = False) -> Callable[[], Case]:
    def build() -> Case:
        model = _hf(name, config, model_class)
        extra = {"decoder_input_ids": "input_ids"} if seq2seq else None
        names = ("input_ids", "attention_mask")
        return Case(FirstOutput(model, names, extra), _text(), names)

    return build


def vision(name: str, config: dict, size: int = 32, model_class: str | None = None) -> Callable[[], Case]:
    def build() -> Case:
        model = _hf(name, config, model_class)
        seeded = torch.Generator().manual_seed(1)
        pixels = torch.randn(BATCH, config.get("num_channels", 3), size, size, generator=seeded)
        return Case(FirstOutput(model, ("pixel_values",)), (pixels,), ("pixel_values",))

    return build


def audio(name: str, config: dict) -> Callable[[], Case]:
    def build() -> Case:
        model = _hf(name, config)
        values = torch.randn(BATCH, 400, generator=torch.Generator().manual_seed(2))
        return Case(FirstOutput(model, ("input_values",)), (values,), ("input_values",))

    return build


def whisper() -> Case:
    config = dict(vocab_size=VOCAB, d_model=H, encoder_layers=1, decoder_layers=1, encoder_attention_heads=HEADS,
                  decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, num_mel_bins=8,
                  max_source_positions=16, max_target_positions=POS, use_cache=False, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    model = _hf("Whisper", config)
    feats = torch.randn(BATCH, 8, 32, generator=torch.Generator().manual_seed(3))
    ids, _ = _text()
    return Case(FirstOutput(model, ("input_features", "decoder_input_ids")), (feats, ids),
                ("input_features", "decoder_input_ids"))


VIT = dict(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
           image_size=32, patch_size=8)
W2V = dict(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
           conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=16,
           num_conv_pos_embedding_groups=2, vocab_size=VOCAB)


# --------------------------------------------------------------------------- hand-written norms (user styles)


class _Weighted(nn.Module):
    """A hand-written norm's weight, N(1, 0.2) over ``shape``."""

    shape: tuple[int, ...] = (H,)

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(*self.shape) * 0.2 + 1)


class _Affine(_Weighted):
    """A hand-written norm's weight and bias, N(0, 0.2), over ``shape``."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(*self.shape) * 0.2)


class RMSPowMeanRsqrt(_Weighted):
    """LLaMA style: fp32 statistics, x * rsqrt(mean(x^2) + eps), cast back, times weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(dtype)


class RMSSquareSqrtDiv(_Weighted):
    """x / sqrt(mean(x*x) + eps) * w, no casts."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + 1e-5) * self.weight


class RMSNoKeepdim(_Weighted):
    """keepdim=False, then unsqueeze: x * (mean(x^2) + eps).rsqrt()[..., None]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (x.square().mean(-1) + 1e-5).rsqrt().unsqueeze(-1) * self.weight


class RMSPowMinusHalf(_Weighted):
    """torch.pow(var + eps, -0.5) and the weight first."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.pow(torch.mean(x**2, dim=-1, keepdim=True) + 1e-5, -0.5))


class TorchRMSNorm(nn.Module):
    """torch.nn.RMSNorm (exported as RMSNormalization at opset 23 by dynamo)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(H, eps=1e-6)
        with torch.no_grad():
            self.norm.weight.normal_(1, 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


class LNVarUnbiasedFalse(_Affine):
    """(x - mean) / sqrt(var(unbiased=False) + eps) * w + b."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, unbiased=False, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-5) * self.weight + self.bias


class LNVarMean(_Affine):
    """torch.var_mean(correction=0) and x * rsqrt, bias first."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var, mean = torch.var_mean(x, dim=-1, keepdim=True, correction=0)
        return self.bias + (x - mean) * torch.rsqrt(var + 1e-5) * self.weight


class LNFp32Autocast(_Affine):
    """Autocast-like: F.layer_norm in float32 around a half model, cast back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.float(), (H,), self.weight.float(), self.bias.float(), 1e-5)
        return y.to(x.dtype)


class LNHandFp32(_Weighted):
    """Hand-written LayerNorm with float32 statistics (Cohere/OLMo style), mean-centred, no bias."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        mean = h.mean(-1, keepdim=True)
        var = (h - mean).pow(2).mean(-1, keepdim=True)
        h = (h - mean) * torch.rsqrt(var + 1e-5)
        return (self.weight.to(torch.float32) * h).to(dtype)


class LNLastTwoDims(_Affine):
    """F.layer_norm over the last two dims, and a hand-written mean over (-2, -1)."""

    shape = (SEQ, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x, (SEQ, H), self.weight, self.bias, 1e-5)
        mean = y.mean((-2, -1), keepdim=True)
        var = ((y - mean) ** 2).mean((-2, -1), keepdim=True)
        return (y - mean) / (var + 1e-5).sqrt() * self.weight


class LNStdOutsideEps(_Weighted):
    """(x - mean) / (std + eps): NOT a LayerNorm (epsilon outside the root). Must stay."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        return (x - mean) / (x.std(-1, unbiased=False, keepdim=True) + 1e-5) * self.weight


class L2Normalize(_Weighted):
    """F.normalize(x) * sqrt(d) * w: NOT an RMSNorm (max(||x||, eps), not sqrt(mean + eps)). Must stay."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=-1) * math.sqrt(H) * self.weight + x / x.norm(dim=-1, keepdim=True)


class LNSumDivN(_Affine):
    """Means written as x.sum(-1) / x.shape[-1]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        mean = x.sum(-1, keepdim=True) / n
        var = ((x - mean) ** 2).sum(-1, keepdim=True) / n
        return (x - mean) * (var + 1e-5).rsqrt() * self.weight + self.bias


class RMSPaperStyle(_Weighted):
    """The RMSNorm paper's code: x / (||x|| * d^-1/2 + eps). NOT an RMSNorm (epsilon outside the root). Must stay."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = x.norm(2, dim=-1, keepdim=True) * H ** -0.5
        return self.weight * (x / (rms + 1e-8))


class LNStdUnbiased(_Affine):
    """Annotated-Transformer LayerNorm: (x - mean) / (x.std() + eps), unbiased std. NOT a LayerNorm. Must stay."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        return self.weight * (x - mean) / (x.std(-1, keepdim=True) + 1e-6) + self.bias


class OtherNorms(nn.Module):
    """GroupNorm (2 and 1 groups), InstanceNorm, BatchNorm (eval) on NCHW: none is a LayerNorm over the last axis."""

    def __init__(self) -> None:
        super().__init__()
        self.gn = nn.GroupNorm(2, 8)
        self.gn1 = nn.GroupNorm(1, 8)
        self.inorm = nn.InstanceNorm2d(8, affine=True)
        self.bn = nn.BatchNorm2d(8)
        for m in (self.gn, self.gn1, self.inorm, self.bn):
            with torch.no_grad():
                m.weight.normal_(1, 0.2)
                m.bias.normal_(0, 0.2)
        self.bn.running_mean.normal_(0, 0.2)
        self.bn.running_var.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gn(x) + self.gn1(x) + self.inorm(x) + self.bn(x)


def handwritten(module_class: type[nn.Module], norms: int,
                shape: tuple[int, ...] = (BATCH, SEQ, H)) -> Callable[[], Case]:
    def build() -> Case:
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(4))
        return Case(module_class(), (x,), ("x",), norms=norms)

    return build


def cases() -> dict[str, tuple[Callable[[], Case], bool]]:
    """name -> (builder, is a decoder LLM: swept in fp16/bf16 and at opset 23 too)."""
    llm = lambda name, **kw: text(name, {**LLM, **kw})  # noqa: E731
    return {
        # decoder LLMs (RMS norms, q/k norms, (1 + w), LayerNorm without bias)
        "gemma": (llm("Gemma"), True),
        "gemma2": (llm("Gemma2", sliding_window=4), True),
        "gemma3": (text("Gemma3Text", {**LLM, "sliding_window": 4}), True),
        "qwen2": (llm("Qwen2"), True),
        "qwen3": (llm("Qwen3"), True),
        "mistral": (llm("Mistral"), True),
        "phi3": (llm("Phi3", pad_token_id=0), True),
        "olmo": (llm("Olmo"), True),
        "olmo2": (llm("Olmo2"), True),
        "cohere": (llm("Cohere"), True),
        "stablelm": (llm("StableLm"), True),
        "falcon": (text("Falcon", dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, use_cache=False)), True),
        "gpt_neox": (llm("GPTNeoX"), True),
        "gptj": (text("GPTJ", dict(vocab_size=VOCAB, n_embd=H, n_layer=LAYERS, n_head=HEADS, n_positions=POS,
                                  rotary_dim=4, use_cache=False)), True),
        "bloom": (text("Bloom", dict(vocab_size=VOCAB, hidden_size=H, n_layer=LAYERS, n_head=HEADS,
                                    use_cache=False)), True),
        "opt": (text("OPT", dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=LAYERS, ffn_dim=FFN,
                                num_attention_heads=HEADS, word_embed_proj_dim=H, max_position_embeddings=POS,
                                use_cache=False)), True),
        "mpt": (text("Mpt", dict(vocab_size=VOCAB, d_model=H, n_layers=LAYERS, n_heads=HEADS, max_seq_len=POS,
                                use_cache=False)), True),
        "mamba": (text("Mamba", dict(vocab_size=VOCAB, hidden_size=H, state_size=4, num_hidden_layers=LAYERS,
                                    expand=2, conv_kernel=2, use_cache=False)), True),
        "rwkv": (text("Rwkv", dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=LAYERS,
                                  attention_hidden_size=H, intermediate_size=FFN, context_length=POS,
                                  use_cache=False)), True),
        # encoder-decoders
        "bart": (text("Bart", SEQ2SEQ, seq2seq=True), False),
        "mbart": (text("MBart", SEQ2SEQ, seq2seq=True), False),
        "marian": (text("Marian", SEQ2SEQ, seq2seq=True), False),
        "t5": (text("T5", T5, seq2seq=True), False),
        "mt5": (text("MT5", T5, seq2seq=True), False),
        "umt5": (text("UMT5", T5, seq2seq=True), False),
        "whisper": (whisper, False),
        # encoders
        "clip_text": (text("CLIPText", dict(ENC, projection_dim=H), model_class="CLIPTextModel"), False),
        "siglip_text": (text("SiglipText", dict(ENC, projection_size=H), model_class="SiglipTextModel"), False),
        "longformer": (text("Longformer", dict(ENC, attention_window=4, max_position_embeddings=POS + 2)), False),
        "electra": (text("Electra", dict(ENC, embedding_size=16)), False),
        "albert": (text("Albert", dict(ENC, embedding_size=16)), False),
        "deberta": (text("Deberta", ENC), False),
        "deberta_v2": (text("DebertaV2", ENC), False),
        "roformer": (text("RoFormer", dict(ENC, embedding_size=H)), False),
        "xlm_roberta": (text("XLMRoberta", dict(ENC, max_position_embeddings=POS + 2)), False),
        "mpnet": (text("MPNet", dict(ENC, max_position_embeddings=POS + 2)), False),
        "funnel": (text("Funnel", dict(vocab_size=VOCAB, d_model=H, n_head=HEADS, d_head=H // HEADS, d_inner=FFN,
                                      block_sizes=[1, 1], num_decoder_layers=1)), False),
        # vision
        "clip_vision": (vision("CLIPVision", dict(VIT, projection_dim=H), model_class="CLIPVisionModel"), False),
        "siglip_vision": (vision("SiglipVision", VIT, model_class="SiglipVisionModel"), False),
        "vit": (vision("ViT", VIT), False),
        "deit": (vision("DeiT", VIT), False),
        "beit": (vision("Beit", dict(VIT, use_mean_pooling=True)), False),
        "dinov2": (vision("Dinov2", VIT), False),
        "swin": (vision("Swin", dict(embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, image_size=32,
                                     patch_size=4)), False),
        "swinv2": (vision("Swinv2", dict(embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
                                         image_size=32, patch_size=4)), False),
        "convnext": (vision("ConvNext", dict(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2)), False),
        "convnextv2": (vision("ConvNextV2", dict(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2)), False),
        "segformer": (vision("Segformer", dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                                               hidden_sizes=[8, 16], num_attention_heads=[1, 2],
                                               patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2],
                                               decoder_hidden_size=16)), False),
        "mobilevit": (vision("MobileViT", dict(image_size=64, hidden_sizes=[16, 24, 32],
                                               neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64]), size=64), False),
        # audio (LayerNorm over channels in the feature extractor with feat_extract_norm="layer")
        "wav2vec2": (audio("Wav2Vec2", dict(W2V, feat_extract_norm="layer", do_stable_layer_norm=True)), False),
        "wav2vec2_group": (audio("Wav2Vec2", W2V), False),
        "hubert": (audio("Hubert", dict(W2V, feat_extract_norm="layer", do_stable_layer_norm=True)), False),
        # hand-written user styles
        "user_rms_pow_mean_rsqrt": (handwritten(RMSPowMeanRsqrt, 1), True),
        "user_rms_square_sqrt_div": (handwritten(RMSSquareSqrtDiv, 1), True),
        "user_rms_no_keepdim": (handwritten(RMSNoKeepdim, 1), True),
        "user_rms_pow_minus_half": (handwritten(RMSPowMinusHalf, 1), True),
        "user_torch_rmsnorm": (handwritten(TorchRMSNorm, 1), True),
        "user_ln_var_unbiased_false": (handwritten(LNVarUnbiasedFalse, 1), True),
        "user_ln_var_mean": (handwritten(LNVarMean, 1), True),
        "user_ln_fp32_autocast": (handwritten(LNFp32Autocast, 1), True),
        "user_ln_hand_fp32": (handwritten(LNHandFp32, 1), True),
        "user_ln_last_two_dims": (handwritten(LNLastTwoDims, 2), True),
        "user_ln_sum_div_n": (handwritten(LNSumDivN, 1), True),
        "user_not_norm_std_eps": (handwritten(LNStdOutsideEps, 0), True),
        "user_not_norm_rms_paper": (handwritten(RMSPaperStyle, 0), True),
        "user_not_norm_std_unbiased": (handwritten(LNStdUnbiased, 0), True),
        "user_not_norm_l2": (handwritten(L2Normalize, 0), True),
        "user_not_norm_group_instance_batch": (handwritten(OtherNorms, 0, (BATCH, 8, 5, 6)), True),
    }
