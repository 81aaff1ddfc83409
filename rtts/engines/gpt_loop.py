"""rtts's own autoregressive loop over ChatTTS's GPT (its ``LlamaModel`` and heads).

``ChatTTS.model.GPT.generate`` is replaced, for serving, by :class:`GptLoop`, which keeps
the same sampling recipe (temperature per codebook, ChatTTS's repetition penalty over
the last 16 codes, top-P then top-K, one multinomial draw per codebook, ``manual_seed``
re-seeding every step) but:

- keeps keys/values in a **static cache** preallocated for the batch's longest request:
  no growing ``torch.cat`` of every layer's cache at every step, no per-step input
  re-slicing;
- **evicts rows**: a row that has finished (EOS or its own token limit) or whose request
  was cancelled is removed from the batch at the next step, cache included, so the GPT
  stops spending compute on it and the others' steps get cheaper;
- writes each step's hidden state into one preallocated buffer, so handing the decoder
  a row's hiddens is a view, not a re-stack of the whole history.

One difference from ChatTTS: an EOS drawn at the very first step is masked instead of
regenerating the whole batch (ChatTTS's ``ensure_non_empty``), so an utterance is never
empty and no other row pays for a retry.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["GptLoop", "LoopRow", "LoopStep"]


@dataclass
class LoopRow:
    """One batch row's progress. ``hiddens[:length]`` are final once written."""

    length: int = 0  # tokens generated (EOS excluded)
    finished: bool = False  # EOS drawn, or limit reached
    evicted: bool = False  # no longer computed (finished or cancelled)


@dataclass
class LoopStep:
    """Yielded every ``yield_every`` steps and at the end."""

    step: int
    rows: list[LoopRow]
    hiddens: Any  # tensor (batch, max_new, hidden): row r's hiddens are [r, :length]
    done: bool  # every row finished or evicted


class GptLoop:
    """Generate audio-code hidden states for a batch with ChatTTS's GPT modules."""

    def __init__(self, gpt: Any, num_vq: int, eos_token: int) -> None:
        self.gpt = gpt  # ChatTTS.model.GPT (loaded)
        self.num_vq = num_vq
        self.eos = eos_token

    def run(
        self,
        emb: Any,  # (B, T0, H) prompt embeddings, speaker applied
        attention_mask: Any,  # (B, T0), left padding
        limits: Sequence[int],  # per row: max new tokens
        min_tokens: Sequence[int],  # per row: EOS masked before this many
        temperature: float,
        logits_processors: Sequence[Callable[[Any, Any], Any]],
        manual_seed: int | None,
        cancelled: Callable[[int], bool],
        yield_every: int,
    ) -> Generator[LoopStep, None, None]:
        import torch
        import torch.nn.functional as F  # noqa: N812
        from transformers.cache_utils import StaticCache

        gpt, num_vq = self.gpt, self.num_vq
        model = gpt.gpt  # transformers LlamaModel
        device = emb.device
        batch, prompt_len, hidden = emb.shape
        max_new = max(limits)
        rows = [LoopRow() for _ in range(batch)]
        hiddens = torch.empty(batch, max_new, hidden, dtype=torch.float32, device=device)
        codes = torch.empty(batch, max_new, num_vq, dtype=torch.long, device=device)
        cache = StaticCache(config=model.config, max_cache_len=prompt_len + max_new)
        mask = attention_mask.to(device=device, dtype=torch.long)
        padded = bool((mask == 0).any())
        full_mask = torch.ones(batch, prompt_len + max_new, dtype=torch.long, device=device)
        full_mask[:, :prompt_len] = mask
        position_ids = (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 1)
        next_pos = position_ids[:, -1:] + 1  # (B, 1)
        live = torch.arange(batch, device=device)  # batch rows still computed, in order
        live_rows = list(range(batch))
        gen = torch.Generator(device=device) if manual_seed is not None else None
        temp = torch.tensor(temperature, dtype=torch.float32, device=device)
        limits_t = torch.tensor(list(limits), device=device)
        min_t = torch.tensor([max(1, m) for m in min_tokens], device=device)
        inputs = emb
        step = 0
        with torch.no_grad():
            for step in range(max_new):
                seen = prompt_len + step
                if step == 0:
                    cache_position = torch.arange(prompt_len, device=device)
                    pos = position_ids
                else:
                    cache_position = torch.tensor([seen], device=device)
                    pos = next_pos
                    next_pos = next_pos + 1
                mask_len = seen if step == 0 else seen + 1
                out = model(
                    inputs_embeds=inputs.to(gpt.device_gpt, model.dtype),
                    attention_mask=(full_mask.index_select(0, live)[:, :mask_len]
                                    if padded else None),
                    position_ids=pos, past_key_values=cache, cache_position=cache_position,
                    use_cache=True,
                )
                h = out.last_hidden_state[:, -1].to(device, torch.float32)  # (b, H)
                del out
                hiddens[live, step] = h
                logits = torch.stack([head(h) for head in gpt.head_code], 2)  # (b, V, vq)
                logits = logits.permute(0, 2, 1).reshape(-1, logits.size(1)).float()
                history = codes.index_select(0, live)[:, :step]  # (b, step, vq)
                history = history.permute(0, 2, 1).reshape(logits.size(0), step)
                logits = logits / temp
                for proc in logits_processors:
                    logits = proc(history, logits)
                early = (min_t.index_select(0, live) > step).repeat_interleave(num_vq)
                if bool(early.any()):
                    logits[early, self.eos] = -torch.inf
                scores = F.softmax(logits, dim=-1)
                if manual_seed is not None:
                    assert gen is not None
                    gen.manual_seed(manual_seed)  # ChatTTS re-seeds at every step
                drawn = torch.multinomial(scores, num_samples=1, generator=gen)
                drawn = drawn.view(-1, num_vq)  # (b, vq)
                codes[live, step] = drawn
                eos = drawn.eq(self.eos).any(1).tolist()
                at_limit = (limits_t.index_select(0, live) <= step + 1).tolist()
                keep: list[int] = []
                for k, r in enumerate(live_rows):
                    row = rows[r]
                    if eos[k]:
                        row.finished = True
                    else:
                        row.length = step + 1
                        if at_limit[k]:
                            row.finished = True
                    if row.finished or cancelled(r):
                        row.evicted = True
                    else:
                        keep.append(k)
                done = not keep
                # Yield on schedule, and at once when a row ends (its last audio is due).
                if done or len(keep) < len(live_rows) or (step + 1) % yield_every == 0:
                    yield LoopStep(step + 1, rows, hiddens, done)
                if done:
                    return
                if len(keep) < len(live_rows):
                    idx = torch.tensor(keep, device=device)
                    _evict(cache, idx)
                    live = live.index_select(0, idx)
                    live_rows = [live_rows[k] for k in keep]
                    drawn = drawn.index_select(0, idx)
                    next_pos = next_pos.index_select(0, idx)
                # (b, 1, H): the codebooks' embeddings summed, in ChatTTS's order
                inputs = torch.stack([gpt.emb_code[v](drawn[:, v:v + 1]) for v in range(num_vq)],
                                     3).sum(3)
        yield LoopStep(step + 1, rows, hiddens, True)


def _evict(cache: Any, keep: Any) -> None:
    """Keep only batch rows ``keep`` in every layer of a static cache (in place)."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            layer.keys = layer.keys.index_select(0, keep)
            layer.values = layer.values.index_select(0, keep)
            layer.batch_size = int(keep.numel())
