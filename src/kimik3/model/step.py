"""A `Step`: the new tokens of N sequences packed in one row [1, T], and where each reads and writes its state.

Legend: N sequences, T packed tokens, W conv window, MB blocks per block table, Bs block size, Tq the longest long
chunk, Sk its key span, E exported snapshots, Nv sequences verifying a draft, L the longest of their rows. Sequence
n owns KDA slot `slots[n]` and the MLA blocks of its block table; it has `cached[n]` tokens in the pool and brings
`lens[n]` new ones.

MLA splits the step in two: short parts (decode rows, speculative drafts, a prompt's tail) attend in the latent
space through `kimik3.ops.mla.paged_latent_attention`, whose work follows each sequence's cached tokens; long parts
(prefill) expand their keys per head and attend under a mask over just their own key span. So a prefill chunk
never pads the decode rows that share its step to its length, and no step's work grows with `max_model_len`. Where
the split falls is the caller's (`build_step`'s `expanded_until`): by chunk length for the explicit cache, by
position in a prompt for the engine (`prompt_expanded_until`), so that a prompt's bits do not depend on its chunks.

A sequence verifying a speculative draft (`VerifyRows`) runs its row like any other, but the forward leaves its
KDA slot as it was: which of its tokens are kept is known only after the logits, and the commit then runs the delta
rule again over just those (`KimiDeltaAttention.commit`, from the inputs each KDA layer gave back), so the slot never
holds a rejected token's state and no per-token state is stored. A `Step` is read by the layers, never written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kimik3.ops.mla import EXPANDED_FROM_TOKENS


@dataclass
class LongChunks:
    """The prefill chunks of a step, each attending over its own keys (expanded, padded to [Nl, Tq])."""

    rows: Tensor  # [Tl] packed rows of their tokens
    q_index: Tensor  # [Nl, Tq] rows of `rows`-order tokens of each chunk (padded with its first)
    unpack: Tensor  # [Tl] rows of the flattened [Nl*Tq] outputs that are the chunks' tokens
    key_index: Tensor  # [Nl, Sk] latent pool rows of each chunk's keys
    key_valid: Tensor  # [Nl, Sk] bool
    mask: Tensor  # [Nl, Tq, Sk] bool


@dataclass
class VerifyRows:
    """The sequences of a step that verify a draft: the forward writes no KDA state of theirs and gives back each
    KDA layer's delta-rule inputs and pre-conv inputs of their rows (`KDAStepIO.saved`); the commit writes it."""

    seqs: Tensor  # [Nv] their rows of the step's N
    rows: Tensor  # [Nv, L] the packed rows of their tokens (a shorter row padded with its last)
    tail_rows: Tensor  # [Nv, L+W-1] rows of cat(new pre-conv inputs, slot tails) at chunk offsets -(W-1)..L-1
    others: Tensor | None  # [N-Nv] the step's other sequences (their state the forward writes), None if none


@dataclass
class KDAStepIO:
    """What one KDA layer's cached forward read beyond the state it wrote: the layer returns it, the runner
    collects it (the step itself is never written)."""

    # the states the step exports (prefix snapshots): (recurrent [E, H, K, V], conv q, k, v [E, W-1, P])
    exports: tuple[Tensor, Tensor, Tensor, Tensor] | None = None
    # the verifying rows' inputs for `KimiDeltaAttention.commit`: (k, v, g, beta [Nv, L, ...], q/k/v pre-conv
    # inputs [Nv, L+W-1, P])
    saved: tuple[Tensor, ...] | None = None


@dataclass
class Step:
    # tokens of every chunk when they are all the same (1: a decode step; 1 + k: a graphed verification step):
    # KDA runs its recurrent kernel over [N, row_len]; 0 when they differ (the chunked kernel, varlen)
    row_len: int
    cu_seqlens: Tensor  # [N+1] chunk boundaries in the packed row
    slots: Tensor  # [N]
    block_size: int
    write_index: Tensor  # [T] latent pool rows of the new tokens
    # short chunks: all of them when `short_rows` is None (a decode step), else those rows of the packed row
    short_rows: Tensor | None
    short_cu: Tensor  # [Ns+1] their query boundaries
    short_lens: Tensor  # [Ns] keys of each (cached + new)
    short_tables: Tensor  # [Ns, MB]
    short_max_len: int  # a host bound on short_lens
    long: LongChunks | None = None
    conv_index: Tensor | None = None  # [W, T] rows of cat(new pre-conv inputs [T], slot tails [N*(W-1)]) per tap
    tail_index: Tensor | None = None  # [N, W-1] rows of the same that become each slot's new tail
    checkpoints: list[list[int]] | None = None  # per sequence: chunk offsets (< its length) to export inside
    export_tail_index: Tensor | None = None  # [E, W-1] conv-tail rows of each export
    export_pick: Tensor | None = None  # [E] rows of cat(interior checkpoints [M], final states [N]); None: no exports
    verify: VerifyRows | None = None

    @property
    def decode_only(self) -> bool:
        return self.row_len == 1

    @property
    def num_short(self) -> int:
        return self.short_lens.shape[0]


def uniform_step(slots: Tensor, cached: Tensor, tables: Tensor, *, row_len: int, block_size: int, max_len: int,
                 conv_window: int = 0, pad_block: int = 0) -> Step:
    """`row_len` new tokens for each of N sequences, from device tensors only (a CUDA graph captures it with
    buffers it refills before each replay). `max_len` bounds cached + row_len (static under a graph).

    Decode is row_len 1. A longer row is a verification step (every sequence verifies, `Step.verify`): a
    sequence with fewer tokens is padded with tokens it will not keep, and a padding position past its table
    writes its latent into the `pad_block`."""
    N, L, Bs, device = slots.shape[0], row_len, block_size, slots.device
    if L == 1:
        write = tables.gather(1, (cached // Bs)[:, None])[:, 0] * Bs + cached % Bs
        cu = torch.arange(N + 1, device=device)
        return Step(row_len=1, cu_seqlens=cu, slots=slots, block_size=Bs, write_index=write, short_rows=None,
                    short_cu=cu, short_lens=cached + 1, short_tables=tables, short_max_len=max_len)
    W, MB = conv_window, tables.shape[1]
    pos_NL = cached[:, None] + torch.arange(L, device=device)
    blk_NL = pos_NL // Bs
    block_NL = torch.where(blk_NL < MB, tables.gather(1, blk_NL.clamp(max=MB - 1)), pad_block)
    n = torch.arange(N, device=device)[:, None]

    def ext_rows(off: Tensor) -> Tensor:  # as build_step's, for chunks of L tokens
        return torch.where(off >= 0, n * L + off, N * L + n * (W - 1) + (W - 1) + off)

    j = torch.arange(L, device=device)
    cu = torch.arange(N + 1, device=device) * L
    return Step(row_len=L, cu_seqlens=cu, slots=slots, block_size=Bs,
                write_index=(block_NL * Bs + pos_NL % Bs).flatten(), short_rows=None, short_cu=cu,
                short_lens=cached + L, short_tables=tables, short_max_len=max_len,
                conv_index=torch.stack([ext_rows(j - (W - 1) + w).flatten() for w in range(W)]),
                tail_index=ext_rows(L - (W - 1) + torch.arange(W - 1, device=device)),
                verify=VerifyRows(n[:, 0], torch.arange(N * L, device=device).view(N, L),
                                  ext_rows(torch.arange(-(W - 1), L, device=device)), None))


def build_step(*, slots: list[int], cached: list[int], lens: list[int], tables: list[list[int]], block_size: int,
               conv_window: int, pad_block: int, device: torch.device,
               exports: list[list[int]] | None = None, verify: list[int] | None = None,
               expanded_until: list[int] | None = None) -> Step:
    """The step of N chunks from host lists (eager steps: every shape is known here, nothing is read back).

    Args:
        slots, cached, lens: [N] each sequence's KDA slot, tokens already cached, new tokens.
        tables: N block lists (covering cached + lens positions); padded with `pad_block` to the longest.
        exports: per sequence, offsets from its chunk start (multiples of the KDA chunk, at most its length)
            where the KDA state is exported (each KDA layer returns them: `KDAStepIO.exports`).
        verify: the sequences that verify a draft (`Step.verify`).
        expanded_until: per sequence, the position below which its new tokens attend expanded (MLA's long path),
            the rest in the latent space; a chunk may so be cut in two. None: by chunk length, a whole chunk of
            EXPANDED_FROM_TOKENS tokens or more expanded (`prompt_expanded_until` is the engine's rule instead:
            it depends on the position only, so a prompt's rows compute the same bits however it is chunked).
    """
    N, W, T = len(slots), conv_window, sum(lens)
    if lens == [1] * N and not (exports and any(exports)) and not verify:
        width = max(map(len, tables))
        t = torch.tensor([b + [pad_block] * (width - len(b)) for b in tables], dtype=torch.long)
        return uniform_step(torch.tensor(slots, device=device), torch.tensor(cached, device=device), t.to(device),
                            row_len=1, block_size=block_size, max_len=max(cached) + 1)
    dev = lambda x: torch.as_tensor(x, dtype=torch.long).to(device)  # noqa: E731
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    seq_T = torch.repeat_interleave(torch.arange(N), torch.tensor(lens), output_size=T)
    off_T = torch.arange(T) - torch.tensor(starts)[seq_T]
    starts_t = torch.tensor(starts)

    def ext_rows(seq: Tensor, off: Tensor) -> Tensor:
        """Row in cat(new [T], tails [N*(W-1)]) of the pre-conv input at chunk offset `off` of sequence `seq`
        (negative offsets reach into the sequence's cached tail, oldest row first)."""
        return torch.where(off >= 0, starts_t[seq] + off, T + seq * (W - 1) + (W - 1) + off)

    taps, rows = torch.arange(W), torch.arange(W - 1)
    conv_index = ext_rows(seq_T[None], off_T[None] - (W - 1) + taps[:, None])
    tail_index = ext_rows(torch.arange(N)[:, None], torch.tensor(lens)[:, None] - (W - 1) + rows)
    pos_T = torch.tensor(cached)[seq_T] + off_T
    width = max(map(len, tables))
    table_NM = torch.tensor([b + [pad_block] * (width - len(b)) for b in tables], dtype=torch.long)
    write_index = table_NM[seq_T, pos_T // block_size] * block_size + pos_T % block_size
    cu = torch.tensor([0, *lens]).cumsum(0)
    if expanded_until is None:
        expanded_until = [c + n if n >= EXPANDED_FROM_TOKENS else c for c, n in zip(cached, lens)]
    # MLA's parts (sequence, first packed row, cached, new tokens): each chunk's expanded head, then its latent rest
    long, short = [], []
    for n in range(N):
        cut = min(max(expanded_until[n] - cached[n], 0), lens[n])
        long += [(n, starts[n], cached[n], cut)] if cut else []
        short += [(n, starts[n] + cut, cached[n] + cut, lens[n] - cut)] if cut < lens[n] else []
    short_rows = torch.cat([torch.arange(a, a + m) for _, a, _, m in short]) if short else \
        torch.zeros(0, dtype=torch.long)
    step = Step(row_len=0, cu_seqlens=dev(cu), slots=dev(slots), block_size=block_size,
                write_index=write_index.to(device),
                short_rows=short_rows.to(device) if long else None,
                short_cu=dev(torch.tensor([0, *(m for *_, m in short)]).cumsum(0)),
                short_lens=dev([c + m for _, _, c, m in short]),
                short_tables=table_NM[[n for n, *_ in short]].to(device),
                short_max_len=max((c + m for _, _, c, m in short), default=0),
                long=_long_chunks(long, table_NM, block_size, device) if long else None,
                conv_index=conv_index.to(device), tail_index=tail_index.to(device))
    if exports is not None and any(exports):
        _add_exports(step, exports, lens, ext_rows, rows, device)
    if verify:
        L, nv = max(lens[n] for n in verify), torch.tensor(verify)
        last = torch.tensor([lens[n] - 1 for n in verify])[:, None]  # offsets past a row's end repeat its last
        vrows = starts_t[nv][:, None] + torch.minimum(torch.arange(L), last)
        others = [n for n in range(N) if n not in verify]
        step.verify = VerifyRows(nv.to(device), vrows.to(device),
                                 ext_rows(nv[:, None], torch.minimum(torch.arange(-(W - 1), L), last)).to(device),
                                 torch.tensor(others, device=device) if others else None)
    return step


def _long_chunks(long: list[tuple[int, int, int, int]], table_NM: Tensor, block_size: int,
                 device: torch.device) -> LongChunks:
    """The expanded parts (sequence, first packed row, cached, new tokens) as `LongChunks`."""
    seqs = [n for n, *_ in long]
    ln = torch.tensor([m for *_, m in long])
    cn = torch.tensor([c for _, _, c, _ in long])
    tq, sk = int(ln.max()), int((cn + ln).max())
    rows = torch.cat([torch.arange(a, a + m) for _, a, _, m in long])
    firsts = torch.tensor([0, *ln.tolist()]).cumsum(0)[:-1]
    j = torch.arange(tq)
    q_valid = j[None] < ln[:, None]
    q_index = torch.where(q_valid, firsts[:, None] + j, firsts[:, None])
    seq = torch.repeat_interleave(torch.arange(len(long)), ln)
    unpack = seq * tq + (torch.arange(rows.shape[0]) - firsts[seq])
    s = torch.arange(sk)
    key_index = table_NM[seqs][:, s // block_size] * block_size + s % block_size
    key_valid = s[None] < (cn + ln)[:, None]
    mask = key_valid[:, None] & (s[None, None] <= (cn[:, None] + j)[..., None])
    # a padding query sees only key 0 (always real): its ignored output stays finite
    mask = torch.where(q_valid[..., None], mask, s[None, None] == 0)
    to = lambda x: x.to(device)  # noqa: E731
    return LongChunks(to(rows), to(q_index), to(unpack), to(key_index), to(key_valid), to(mask))


def prompt_expanded_until(num_prompt: int) -> int:
    """The engine's split of MLA's paths (`build_step`'s `expanded_until`) for a sequence of `num_prompt` prompt
    tokens: positions below the prompt's last multiple of EXPANDED_FROM_TOKENS attend expanded, the rest of the
    prompt and every output position in the latent space. It depends on the position only, not on where the step's
    budget cut the prompt: a prompt prefilled in one chunk or several computes the same bits (by chunk length, a
    prompt's tail split off into a short chunk took the latent path, in one chunk the expanded one)."""
    return num_prompt // EXPANDED_FROM_TOKENS * EXPANDED_FROM_TOKENS


def _add_exports(step: Step, exports: list[list[int]], lens: list[int], ext_rows, rows: Tensor,
                 device: torch.device) -> None:
    interior = [[o for o in offs if o < n] for offs, n in zip(exports, lens)]
    M, pick, e_seq, e_off = sum(map(len, interior)), [], [], []
    m = 0
    for n, offs in enumerate(exports):
        for o in offs:
            if not 0 < o <= lens[n]:
                raise ValueError(f"export offset {o} is outside sequence {n}'s chunk of {lens[n]} tokens")
            pick.append(m if o < lens[n] else M + n)
            m += o < lens[n]
            e_seq.append(n)
            e_off.append(o)
    step.checkpoints = interior if M else None
    # rows = arange(W-1): the W-1 pre-conv inputs ending at each export's offset
    step.export_tail_index = ext_rows(torch.tensor(e_seq)[:, None],
                                      torch.tensor(e_off)[:, None] - rows.shape[0] + rows).to(device)
    step.export_pick = torch.tensor(pick, device=device)
