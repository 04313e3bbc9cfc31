"""Executes one scheduler step on the worker: StepBatch in, StepResult out.

The runner keeps a per-request state table (tokens, block table, computed count),
so a step carries only deltas (see ``shared.protocol``). Each step it:
1. drops finished/preempted requests, adds new ones, extends block tables;
2. flattens the scheduled tokens into one varlen batch in the scheduler's order
   (one-token sequences first, then multi-token chunks: the order the attention
   backends want), so neither the batch nor the results are re-sorted;
3. runs the model (a decode-only step that fits, through ``cuda_graphs.py``: a CUDA
   graph replayed over padded persistent buffers where captured), computes logits only
   for requests that reached the end of their known tokens (a request mid chunked-
   prefill samples nothing), samples, and appends the sampled tokens to its own state
   (the rows of sequences under a grammar are masked first: ``grammar_bitmask.py``);
   requests asking ``prompt_logprobs`` also get logits for this chunk's prompt rows
   (``prompt_logprobs.py``).

Step inputs are built with numpy; on CUDA they go to the device through pinned host
memory, asynchronously (on the CPU the numpy arrays are used as they are).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from services.worker.attention.base import AttentionBackend, AttentionMetadata
from services.worker.cpu_memory import huge_page_zeros
from services.worker.cuda_graphs import DecodeGraphs, needs_rope_plan
from services.worker.grammar_bitmask import GrammarBitmask
from services.worker.models.llama import KVCache, LlamaForCausalLM
from services.worker.prompt_logprobs import compute_prompt_logprobs, plan_prompt_logprobs
from services.worker.sampler import Sampler, SamplingMetadata, SamplingRow
from shared.protocol import NewRequest, PromptLogprobs, StepBatch, StepResult
from shared.sampling_params import SamplingParams


class StepError(RuntimeError):
    """The step message is inconsistent with the runner's state (a scheduler bug)."""


@dataclass
class CachedRequestState:
    request_id: int  # the scheduler's compact sequence id
    token_ids: list[int]  # prompt, then every output token sampled so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    rows: SamplingRow = field(init=False)

    def __post_init__(self) -> None:
        self.rows = SamplingRow(
            self.sampling_params, _TokenSlice(self.token_ids, 0, self.num_prompt_tokens),
            _TokenSlice(self.token_ids, self.num_prompt_tokens, None),
        )


class _TokenSlice:
    """A live read-only view of part of a token list (no per-step copies)."""

    __slots__ = ("_end", "_start", "_tokens")

    def __init__(self, tokens: list[int], start: int, end: int | None) -> None:
        self._tokens, self._start, self._end = tokens, start, end

    def _stop(self) -> int:
        return len(self._tokens) if self._end is None else self._end

    def __len__(self) -> int:
        return self._stop() - self._start

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        if isinstance(index, slice):
            return self._tokens[self._start : self._stop()][index]
        n = len(self)
        if not -n <= index < n:
            raise IndexError(index)
        return self._tokens[self._start + (index % n)]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._tokens[self._start : self._stop()])


def kv_cache_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.config  # this rank's KV heads only (tensor parallelism splits them)
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * model.shard.num_kv_heads * cfg.head_dim * elem


def allocate_kv_caches(
    model: LlamaForCausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
    device: torch.device | str,
) -> list[KVCache]:
    cfg = model.config
    shape = (num_blocks, block_size, model.shard.num_kv_heads, cfg.head_dim)
    if torch.device(device).type == "cpu":  # one pool on huge pages: see cpu_memory.py
        pool = huge_page_zeros((cfg.num_hidden_layers, 2, *shape), dtype)
        return [(pool[layer, 0], pool[layer, 1]) for layer in range(cfg.num_hidden_layers)]
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(cfg.num_hidden_layers)
    ]


@dataclass
class _FlatBatch:
    """One step's batch on the host; T tokens of B sequences."""

    order: list[CachedRequestState]  # batch order: decodes, then prefills
    num_decodes: int  # the first num_decodes sequences have one new token each
    query_start_loc: list[int]  # [B + 1]
    seq_lens: np.ndarray  # [B] int64: tokens in the cache after this step
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    block_tables: np.ndarray  # [B, max_blocks] int64, padded with 0
    slot_mapping: np.ndarray  # [T] int64
    sample_rows: list[int]  # indexes into order of the requests that sample
    logit_indices: np.ndarray  # [num_sample] flat index of each sampler's last token


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model
        self.tp = model.tp  # rank 0 samples and answers; every rank runs the forward
        self.backend = backend
        self.device = torch.device(device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_caches(model, num_blocks, block_size, kv_dtype, self.device)
        self.sampler = Sampler(model.config.vocab_size, model.config.eos_token_ids, self.device)
        self.requests: dict[int, CachedRequestState] = {}
        # requests asking prompt_logprobs whose prompt is not computed yet (empty: no cost)
        self._prompt_logprobs_ids: set[int] = set()
        self.graphs: DecodeGraphs | None = None  # enable_decode_graphs

    def enable_decode_graphs(self, max_batch_size: int, max_model_len: int,
                             capture: bool) -> DecodeGraphs:
        """Send decode-only steps of up to ``max_batch_size`` sequences through the padded
        graph path (``cuda_graphs.py``); ``capture``: record its CUDA graphs now (CUDA
        only), else the path runs eagerly (the CPU and tests)."""
        if self.tp.size > 1:
            raise ValueError("decode graphs run on a single rank (tensor parallel: not yet)")
        graphs = DecodeGraphs(self.model, self.backend, self.kv_caches, max_batch_size,
                              max_model_len, self.block_size, self.device)
        if capture:
            graphs.capture()
        self.graphs = graphs
        return graphs

    # -- state table ---------------------------------------------------------------
    def _apply_deltas(self, batch: StepBatch) -> None:
        for rid in batch.finished_request_ids:
            self.requests.pop(rid, None)
            self._prompt_logprobs_ids.discard(rid)
        for new in batch.new_requests:
            self.requests[new.request_id] = self._new_state(new)
            if new.sampling_params.prompt_logprobs is not None:
                self._prompt_logprobs_ids.add(new.request_id)
        for running in batch.running_requests:
            state = self.requests.get(running.request_id)
            if state is None:
                raise StepError(f"running request {running.request_id!r} has no worker state")
            state.block_ids.extend(running.new_block_ids)

    @staticmethod
    def _new_state(new: NewRequest) -> CachedRequestState:
        return CachedRequestState(
            request_id=new.request_id,
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            sampling_params=new.sampling_params,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
        )

    # -- one step --------------------------------------------------------------------
    def execute(self, batch: StepBatch) -> StepResult:
        return self._execute(batch, keep_logits=False)[0]

    def execute_with_logits(self, batch: StepBatch) -> tuple[StepResult, dict[int, torch.Tensor]]:
        """Runs the step; also returns request_id -> raw logits [vocab] of each sampler."""
        return self._execute(batch, keep_logits=True)

    @torch.inference_mode()
    def _execute(self, batch: StepBatch,
                 keep_logits: bool) -> tuple[StepResult, dict[int, torch.Tensor]]:
        self._apply_deltas(batch)
        if not batch.scheduled_request_ids:
            return StepResult(step_id=batch.step_id), {}
        flat = self._flatten(batch)
        argmax, metadata = None, None
        if self.graphs is not None and self._graph_step(flat):
            # decode only: token i is row i; the graph's rows past the step's are padding
            graph_out = self.graphs.run(flat.input_ids, flat.positions, flat.slot_mapping,
                                        flat.seq_lens, flat.block_tables)
            prompt_logprobs: list[PromptLogprobs] = []  # no such request takes the graphs
            n = len(flat.order)
            if len(flat.sample_rows) == n:  # as in every decode step: views, read before
                logits, argmax = graph_out.logits[:n], graph_out.argmax[:n]  # the next replay
            else:
                rows = self._upload(flat.logit_indices)
                logits = graph_out.logits.index_select(0, rows)
                argmax = graph_out.argmax.index_select(0, rows)
        else:
            # the sampled rows (a decode step's are all its rows, in order: no selection)
            rows = (None if len(flat.sample_rows) == len(flat.order) == flat.num_decodes
                    else self._upload(flat.logit_indices))
            if self._scores_prompt(flat):  # prompt logprobs read every row's hidden state
                hidden = self._forward(flat)
                prompt_logprobs = self._prompt_logprobs(flat, hidden)
                if rows is not None:
                    hidden = hidden.index_select(0, rows)
            else:  # only the sampled rows come out: a prefill's others skip the last MLP
                hidden = self._forward(flat, rows)
                prompt_logprobs = []
            if flat.sample_rows and not keep_logits:
                screened, metadata = self._screened_greedy(hidden, flat, batch)
            else:
                screened = None
            if screened is not None:
                logits, argmax = None, screened
            else:  # the model's dtype for the sampler; fp32 for a caller that keeps them
                logits = (self.model.compute_logits(hidden, fp32=keep_logits)
                          if flat.sample_rows else None)
        for state, n in zip(flat.order, np.diff(flat.query_start_loc).tolist()):
            state.num_computed_tokens += n
        if (logits is None and argmax is None) or not flat.sample_rows:
            return StepResult(step_id=batch.step_id, prompt_logprobs=prompt_logprobs), {}
        samplers = [flat.order[i] for i in flat.sample_rows]
        grammar = (self._grammar_bitmask(batch, samplers)
                   if batch.grammar_seq_ids and self.tp.is_first else None)
        if logits is None:  # screened: plain greedy rows, rank 0 of one
            sampled_ids, logprobs = argmax, [None] * len(samplers)
        elif self.tp.is_first:
            if metadata is None:  # not built for the screened head's test
                metadata = self.sampler.metadata([s.rows for s in samplers])
            out = self.sampler.sample(logits, metadata, grammar, argmax)
            sampled_ids, logprobs = out.sampled_token_ids, out.logprobs
        else:  # rank 0 samples; the others take its tokens (their state needs them)
            sampled_ids = torch.empty(len(samplers), dtype=torch.int64, device=self.device)
            logprobs = None
        sampled = self.tp.broadcast_first(sampled_ids).tolist()
        for state, token in zip(samplers, sampled):
            state.token_ids.append(token)
        # samplers are in the scheduler's batch order already
        result = StepResult(
            step_id=batch.step_id,
            request_ids=[s.request_id for s in samplers],
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
        if not keep_logits:
            return result, {}
        if argmax is not None:  # the graph's output: the next replay rewrites it
            logits = logits.clone()
        return result, {s.request_id: logits[j] for j, s in enumerate(samplers)}

    def _screened_greedy(self, hidden: torch.Tensor, flat: _FlatBatch, batch: StepBatch
                         ) -> tuple[torch.Tensor | None, SamplingMetadata | None]:
        """The sampled rows' tokens through the model's screened greedy head
        (``layers/screened_argmax.py``: the full head's argmax without its every column)
        where every row is plain greedy, else None (the full head and the sampler); and
        the rows' sampling metadata where it was built."""
        head = self.model.screened_argmax  # None under tensor parallelism
        if head is None or batch.grammar_seq_ids:
            return None, None
        metadata = self.sampler.metadata([flat.order[i].rows for i in flat.sample_rows])
        if not metadata.is_plain_greedy:
            return None, metadata
        return head(hidden), metadata

    def _prompt_logprobs(self, flat: _FlatBatch, hidden: torch.Tensor) -> list[PromptLogprobs]:
        """Logprobs of the prompt tokens this step's chunks score, for the sequences that
        asked (run before their computed counts advance)."""
        qsl = flat.query_start_loc
        seqs, chunk_starts, chunk_lens = [], [], []
        for i, state in enumerate(flat.order):
            if state.request_id not in self._prompt_logprobs_ids:
                continue
            n = qsl[i + 1] - qsl[i]
            seqs.append((state, state.sampling_params.prompt_logprobs or 0))
            chunk_starts.append(qsl[i])
            chunk_lens.append(n)
            if state.num_computed_tokens + n >= state.num_prompt_tokens - 1:
                self._prompt_logprobs_ids.discard(state.request_id)  # the last one needed
        plan = plan_prompt_logprobs(seqs, chunk_starts, chunk_lens, self.device)
        return [] if plan is None else compute_prompt_logprobs(self.model, hidden, plan)

    def _grammar_bitmask(self, batch: StepBatch, samplers: list[CachedRequestState]) -> GrammarBitmask:
        """The step's structured-output masks, on the rows of the sequences they belong to."""
        row_of = {s.request_id: i for i, s in enumerate(samplers)}
        missing = [sid for sid in batch.grammar_seq_ids if sid not in row_of]
        if missing:
            raise StepError(f"grammar masks for sequences {missing} that do not sample this step")
        try:
            return GrammarBitmask.from_bytes([row_of[sid] for sid in batch.grammar_seq_ids],
                                             batch.grammar_bitmasks, self.sampler.vocab_size,
                                             self.device)
        except ValueError as e:
            raise StepError(str(e)) from None

    def _flatten(self, batch: StepBatch) -> _FlatBatch:
        order: list[CachedRequestState] = []
        num_decodes = 0
        for rid, n in zip(batch.scheduled_request_ids, batch.num_scheduled_tokens, strict=True):
            state = self.requests.get(rid)
            if state is None:
                raise StepError(f"scheduled request {rid!r} has no worker state")
            end = state.num_computed_tokens + n
            if n < 1 or end > len(state.token_ids):
                raise StepError(
                    f"request {rid!r}: {n} tokens scheduled from {state.num_computed_tokens}, "
                    f"but it has {len(state.token_ids)} tokens"
                )
            if -(-end // self.block_size) > len(state.block_ids):
                raise StepError(f"request {rid!r}: {end} tokens but {len(state.block_ids)} blocks")
            if n == 1:
                if num_decodes != len(order):
                    raise StepError(f"request {rid!r}: a one-token sequence after a multi-token one")
                num_decodes += 1
            order.append(state)
        return self._build_batch(order, batch.num_scheduled_tokens, num_decodes)

    def _build_batch(
        self, order: list[CachedRequestState], counts: list[int], num_decodes: int
    ) -> _FlatBatch:
        bs = self.block_size
        starts = np.array([s.num_computed_tokens for s in order], dtype=np.int64)
        counts_np = np.array(counts, dtype=np.int64)
        ends = starts + counts_np
        qsl = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(counts_np, out=qsl[1:])
        total = int(qsl[-1])
        # position of every new token: its sequence's start + its offset in the chunk
        seq_of_token = np.repeat(np.arange(len(order)), counts_np)
        positions = starts[seq_of_token] + (np.arange(total) - qsl[:-1][seq_of_token])
        max_blocks = int(-(-ends.max() // bs))
        block_tables = np.zeros((len(order), max_blocks), dtype=np.int64)
        input_ids = np.empty(total, dtype=np.int64)
        for i, state in enumerate(order):
            nb = min(len(state.block_ids), max_blocks)
            block_tables[i, :nb] = state.block_ids[:nb]
            input_ids[qsl[i] : qsl[i + 1]] = state.token_ids[starts[i] : ends[i]]
        slot_mapping = block_tables[seq_of_token, positions // bs] * bs + positions % bs
        sample_rows = [i for i, s in enumerate(order) if ends[i] == len(s.token_ids)]
        return _FlatBatch(
            order=order,
            num_decodes=num_decodes,
            query_start_loc=qsl.tolist(),
            seq_lens=ends,
            input_ids=input_ids,
            positions=positions,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            sample_rows=sample_rows,
            logit_indices=qsl[1:][sample_rows] - 1,
        )

    def _graph_step(self, flat: _FlatBatch) -> bool:
        """Whether this step runs on the decode graphs (see ``cuda_graphs.py``)."""
        assert self.graphs is not None
        pending = self._prompt_logprobs_ids
        return (
            flat.num_decodes == len(flat.order)
            and self.graphs.fits(len(flat.order), flat.block_tables.shape[1])
            and not (pending and any(s.request_id in pending for s in flat.order))
            and not needs_rope_plan(self.model, int(flat.seq_lens.max()))
        )

    def _scores_prompt(self, flat: _FlatBatch) -> bool:
        """Whether a sequence of the step still scores its prompt (prompt logprobs)."""
        pending = self._prompt_logprobs_ids
        return bool(pending) and any(s.request_id in pending for s in flat.order)

    def _forward(self, flat: _FlatBatch,
                 output_rows: torch.Tensor | None = None) -> torch.Tensor:  # [T, hidden]
        """The eager forward over the step's own varlen tensors (``output_rows``: those
        rows' hidden states only, [R, hidden])."""
        up = self._upload
        qsl = np.array(flat.query_start_loc, dtype=np.int32)
        ends = flat.seq_lens
        meta = AttentionMetadata(
            num_tokens=flat.query_start_loc[-1],
            num_decodes=flat.num_decodes,
            query_start_loc=up(qsl),
            seq_lens=up(ends.astype(np.int32)),
            block_tables=up(flat.block_tables.astype(np.int32)),
            slot_mapping=up(flat.slot_mapping),
            max_query_len=int(np.diff(qsl).max()),
            max_seq_len=int(ends.max()),
            query_start_loc_host=flat.query_start_loc,
            seq_lens_host=ends.tolist(),
        )
        return self.model(up(flat.input_ids), up(flat.positions), self.kv_caches, meta,
                          self.backend, output_rows)

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        """A host array on the runner's device: on CUDA through pinned memory, without
        waiting (torch keeps the pinned block until the copy is done); on the CPU as is."""
        tensor = torch.from_numpy(array)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)
