"""Random-weight ChatTTS checkpoints in ChatTTS's own asset layout (``rtts model make-random``).

The published weights cannot be fetched everywhere (CI, air-gapped machines), yet the
real ChatTTS code must run in tests and benchmarks. This module builds every module
with ChatTTS's and vocos's own classes -- exactly as ``Chat._load`` does -- fills them
with random weights and saves them in the layout ``Chat.load(source="custom")`` reads::

    DIR/asset/{Vocos,DVAE,Decoder,Embed}.safetensors
    DIR/asset/gpt/{config.json,model.safetensors}
    DIR/asset/tokenizer/{tokenizer.json,tokenizer_config.json,special_tokens_map.json}
    DIR/chattts_config.json    rtts: the shape overrides for Chat.config (tiny size)
    DIR/sha256_map.json        rtts: hashes of these files, replacing the package's map
    DIR/RANDOM_WEIGHTS         marker; the server logs loudly that the voice is noise

``tiny`` (~25 MB, fractions of a second per segment on a CPU) is for tests; ``full``
has the published model's shapes (~1.2 GB) and is for benchmarks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

__all__ = ["SIZES", "apply_overrides", "is_random_checkpoint", "make_random_checkpoint"]

logger = logging.getLogger("rtts.checkpoint")

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "gpt": {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
                "num_hidden_layers": 2, "max_position_embeddings": 4096},
        "decoder": {"idim": 64, "odim": 64, "hidden": 64, "n_layer": 1, "bn_dim": 32},
        "dvae": {
            "encoder": {"idim": 64, "odim": 128, "hidden": 64, "n_layer": 1, "bn_dim": 32},
            "decoder": {"idim": 64, "odim": 64, "hidden": 64, "n_layer": 1, "bn_dim": 32},
            "vq": {"dim": 128, "levels": [5, 5, 5, 5], "G": 2, "R": 2},
        },
        "vocos": {"dim": 64, "intermediate_dim": 128, "num_layers": 1},
    },
    "full": {
        "gpt": {"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12,
                "num_hidden_layers": 20, "max_position_embeddings": 4096},
        "decoder": {"idim": 384, "odim": 384, "hidden": 512, "n_layer": 12, "bn_dim": 128},
        "dvae": {
            "encoder": {"idim": 512, "odim": 1024, "hidden": 256, "n_layer": 12, "bn_dim": 128},
            "decoder": {"idim": 512, "odim": 512, "hidden": 256, "n_layer": 12, "bn_dim": 128},
            "vq": {"dim": 1024, "levels": [5, 5, 5, 5], "G": 2, "R": 2},
        },
        "vocos": {"dim": 512, "intermediate_dim": 1536, "num_layers": 8},
    },
}

NUM_AUDIO_TOKENS = 626
NUM_VQ = 4
LLAMA_VOCAB = 32000  # unused rows (embed_tokens is deleted at load); the real size is unknown

_FILES = {  # sha256_map key -> path under DIR (names from ChatTTS/res/sha256_map.json)
    "sha256_asset_Decoder_safetensors": "asset/Decoder.safetensors",
    "sha256_asset_DVAE_safetensors": "asset/DVAE.safetensors",
    "sha256_asset_Embed_safetensors": "asset/Embed.safetensors",
    "sha256_asset_Vocos_safetensors": "asset/Vocos.safetensors",
    "sha256_asset_gpt_config_json": "asset/gpt/config.json",
    "sha256_asset_gpt_model_safetensors": "asset/gpt/model.safetensors",
    "sha256_asset_tokenizer_special_tokens_map_json": "asset/tokenizer/special_tokens_map.json",
    "sha256_asset_tokenizer_tokenizer_config_json": "asset/tokenizer/tokenizer_config.json",
    "sha256_asset_tokenizer_tokenizer_json": "asset/tokenizer/tokenizer.json",
}

# Tags ChatTTS prompts and users use. Refine output keeps only ids below [break_0], so the
# tags a refined text may carry come first.
_KEPT_TAGS = ["[uv_break]", "[v_break]", "[lbreak]", "[llbreak]", "[laugh]", "[undefine]"]
_OTHER_TAGS = (
    [f"[break_{i}]" for i in range(8)] + [f"[oral_{i}]" for i in range(10)]
    + [f"[laugh_{i}]" for i in range(3)] + [f"[speed_{i}]" for i in range(10)]
    + ["[Stts]", "[Ptts]", "[Sbreak]", "[Pbreak]", "[Ebreak]", "[spk_emb]", "[empty_spk]",
       "[music]", "[pure]"]
)
REQUIRED_TAGS = ("[spk_emb]", "[break_0]", "[Ebreak]", "[Stts]", "[Ptts]", "[empty_spk]",
                 "[Sbreak]", "[Pbreak]", "[speed_5]", "[uv_break]", "[laugh]", "[lbreak]")


def is_random_checkpoint(path: Path) -> bool:
    return (path / "RANDOM_WEIGHTS").is_file()


def _vocab() -> list[str]:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    ascii_chars = [chr(c) for c in range(33, 127)]
    pieces = ["##" + c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"]
    cjk_punct = list("，。、！？；：“”‘’（）《》【】—…·")
    budget = 21178 - len(specials) - len(ascii_chars) - len(pieces) - len(cjk_punct) \
        - len(_KEPT_TAGS) - len(_OTHER_TAGS)
    cjk = [chr(c) for c in range(0x4E00, 0x4E00 + min(budget, 0x9FFF - 0x4E00 + 1))]
    return specials + ascii_chars + pieces + cjk_punct + cjk


def _build_tokenizer(out: Path) -> int:
    from tokenizers import AddedToken
    from transformers import BertTokenizerFast  # type: ignore[attr-defined]

    vocab = {tok: i for i, tok in enumerate(_vocab())}
    tok = BertTokenizerFast(vocab=vocab, do_lower_case=False, tokenize_chinese_chars=True)
    tok.add_tokens([AddedToken(t, special=True, normalized=False)
                    for t in _KEPT_TAGS + _OTHER_TAGS])
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    (out / "special_tokens_map.json").write_text(json.dumps({
        "unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]",
        "cls_token": "[CLS]", "mask_token": "[MASK]"}, indent=2))
    for tag in REQUIRED_TAGS:
        if tok.convert_tokens_to_ids(tag) == tok.unk_token_id:
            raise RuntimeError(f"tokenizer lost the tag {tag}")
    return len(tok)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def apply_overrides(chat: Any, ckpt_dir: Path) -> None:
    """Point a ``ChatTTS.Chat`` at a random checkpoint: shapes and hashes, before ``load``.

    Whole config sub-objects are replaced (never mutated): ChatTTS's dataclass defaults
    are shared class-level instances, so mutating one would change every Chat.
    """
    from ChatTTS.config import config as C  # noqa: N812

    spec = json.loads((ckpt_dir / "chattts_config.json").read_text())
    g, d, dv, vc = spec["gpt"], spec["decoder"], spec["dvae"], spec["vocos"]
    hidden = g["hidden_size"]
    text_tokens = spec["num_text_tokens"]
    cfg = C.Config(
        path=C.Path(),
        decoder=C.Decoder(**d),
        dvae=C.DVAE(encoder=C.Decoder(**dv["encoder"]), decoder=C.Decoder(**dv["decoder"]),
                    vq=C.VQ(dim=dv["vq"]["dim"], levels=tuple(dv["vq"]["levels"]),
                            G=dv["vq"]["G"], R=dv["vq"]["R"])),
        gpt=C.GPT(hidden_size=hidden, intermediate_size=g["intermediate_size"],
                  num_attention_heads=g["num_attention_heads"],
                  num_hidden_layers=g["num_hidden_layers"],
                  max_position_embeddings=g["max_position_embeddings"],
                  num_audio_tokens=NUM_AUDIO_TOKENS, num_text_tokens=text_tokens,
                  num_vq=NUM_VQ),
        embed=C.Embed(hidden_size=hidden, num_audio_tokens=NUM_AUDIO_TOKENS,
                      num_text_tokens=text_tokens, num_vq=NUM_VQ),
        vocos=C.Vocos(
            feature_extractor=C.FeatureExtractor(init_args=C.FeatureExtractorInitArgs()),
            backbone=C.Backbone(init_args=C.BackboneInitArgs(
                input_channels=100, dim=vc["dim"], intermediate_dim=vc["intermediate_dim"],
                num_layers=vc["num_layers"])),
            head=C.FourierHead(init_args=C.FourierHeadInitArgs(dim=vc["dim"])),
        ),
        spk_stat=spec["spk_stat"],
    )
    chat.config = cfg
    chat.sha256_map = json.loads((ckpt_dir / "sha256_map.json").read_text())


def make_random_checkpoint(out: Path, size: str = "tiny", seed: int = 0) -> Path:
    """Build a random-weight checkpoint under ``out``; returns ``out``."""
    import numpy as np
    import pybase16384 as b14
    import torch
    from ChatTTS.model.dvae import DVAE
    from ChatTTS.model.embed import Embed
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaModel
    from vocos import Vocos
    from vocos.pretrained import instantiate_class

    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}")
    shape = SIZES[size]
    out = Path(out)
    asset = out / "asset"
    (asset / "gpt").mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    text_tokens = _build_tokenizer(asset / "tokenizer")
    hidden = shape["gpt"]["hidden_size"]
    rng = np.random.default_rng(seed)
    std = np.full(hidden, 1.0, np.float16) * np.float16(rng.uniform(0.5, 1.5))
    mean = rng.normal(0, 0.1, hidden).astype(np.float16)
    spk_stat = b14.encode_to_string(np.concatenate([std, mean]).astype(np.float16).tobytes())
    spec = {"size": size, "num_text_tokens": text_tokens, "spk_stat": spk_stat, **shape}
    (out / "chattts_config.json").write_text(json.dumps(spec, indent=1, ensure_ascii=False))

    class _Holder:
        config: Any = None
        sha256_map: Any = None

    holder = _Holder()
    (out / "sha256_map.json").write_text("{}")
    apply_overrides(holder, out)
    cfg = holder.config
    from dataclasses import asdict

    with torch.no_grad():
        vocos = Vocos(
            feature_extractor=instantiate_class((), asdict(cfg.vocos.feature_extractor)),
            backbone=instantiate_class((), asdict(cfg.vocos.backbone)),
            head=instantiate_class((), asdict(cfg.vocos.head)),
        )
        save_file(_contiguous(vocos.state_dict()), str(asset / "Vocos.safetensors"))
        dvae = DVAE(decoder_config=asdict(cfg.dvae.decoder),
                    encoder_config=asdict(cfg.dvae.encoder), vq_config=asdict(cfg.dvae.vq),
                    dim=cfg.dvae.decoder.idim, coef=None)
        coef = str(dvae)
        save_file(_contiguous(dvae.state_dict()), str(asset / "DVAE.safetensors"))
        decoder = DVAE(decoder_config=asdict(cfg.decoder), dim=cfg.decoder.idim, coef=coef)
        save_file(_contiguous(decoder.state_dict()), str(asset / "Decoder.safetensors"))
        embed = Embed(hidden, NUM_AUDIO_TOKENS, text_tokens, NUM_VQ)
        save_file(_contiguous(embed.state_dict()), str(asset / "Embed.safetensors"))
        g = shape["gpt"]
        llama = LlamaModel(LlamaConfig(
            hidden_size=hidden, intermediate_size=g["intermediate_size"],
            num_attention_heads=g["num_attention_heads"],
            num_hidden_layers=g["num_hidden_layers"],
            max_position_embeddings=g["max_position_embeddings"],
            vocab_size=LLAMA_VOCAB if size == "full" else 8,
        ))
        llama.save_pretrained(str(asset / "gpt"), max_shard_size="100GB")

    hashes = {key: _sha256(out / rel) for key, rel in _FILES.items()}
    (out / "sha256_map.json").write_text(json.dumps(hashes, indent=1))
    (out / "RANDOM_WEIGHTS").write_text(
        f"Random-weight ChatTTS checkpoint ({size}) made by `rtts model make-random`.\n"
        "It runs the real ChatTTS code but speaks noise. Not for real use.\n")
    logger.info("random %s checkpoint written to %s", size, out)
    return out


def _contiguous(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().contiguous().clone() for k, v in state.items()}


def ensure_default_checkpoint(path: Path) -> Path:
    """The embedded default: generate the tiny random checkpoint once, atomically."""
    if (path / "sha256_map.json").is_file() and is_random_checkpoint(path):
        return path
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    make_random_checkpoint(tmp, "tiny")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(path)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path
