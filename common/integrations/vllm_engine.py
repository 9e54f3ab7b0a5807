"""`--rollout-engine vllm`: rollouts from a vLLM engine living in the training process (colocated).

One `vllm.LLM` per process, made once at start-up from the policy's folder (`VLLMEngine`). Before a
rollout phase whose policy changed, the policy's current weights are pushed into the engine in
memory (`sync`): no disk round-trip. `common.core.generation.generate(..., engine=...)` then hands the batch
to `VLLMEngine.generate`, which returns the same `Generation` as our own decoding loop.

Choices (docs/rollout.md has the why and the measurements):
- Weight sync: vLLM's in-place reload, `collective_rpc("reload_weights", weights_iterator=...)`: the
  engine's own loader maps Hugging Face names onto its fused layers (q/k/v, gate/up) and repacks
  them for its kernels. The older route, calling the engine model's `load_weights` directly, fails
  on the CPU backend ('Parameter' object has no attribute 'weight_loader'): after loading, vLLM
  replaces the parameters it processed by plain ones. The engine runs in this process
  (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the iterator is passed by reference. The prefix cache is
  reset after each sync (its KV entries came from the old weights).
- What is pushed: `common.parallel.weight_stream.engine_weights`, a stream of one tensor at a time in the engine's dtype
  (LoRA merged per layer, a 4-bit base dequantised, FSDP2 / ZeRO-3 shards gathered one parameter at a time where
  the policy rests: with an engine, `unwrap_for_generation` gathers nothing), and only when the trainable weights'
  fingerprint changed. One rollout phase = one wake (--vllm-sleep) and one push (`begin_phase` / `end_phase`).
- Seeds: each request carries its sample's seed (`SamplingParams(seed=...)`, the same
  `mix_seed(seed, step, uid)` as the hf engine), so a response depends on its own seed, not on the
  batch around it. The draws differ from the hf engine's: same seed, different (equally valid) sample.
- Log-probs: `logprobs_mode="processed_logprobs"`, the sampled token's log-prob after temperature
  (and after top-k / top-p, which renormalise: the distribution actually sampled). The trainer
  recomputes pi_old from the policy whenever the engine is vllm.
- The model's generation_config.json is not applied (`generation_config="vllm"`), as in the hf engine:
  only our sampling arguments shape the distribution, and only the tokenizer's EOS ends a response.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from common.core.chat import stop_ids
from common.core.errors import UserError
from common.parallel.weight_stream import engine_weights, sum_and_squares, trainable_fingerprint


def require_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise UserError(
            f"--rollout-engine vllm: vLLM is not installed ({e}). CPU: pip install -r requirements-vllm.txt; "
            "GPU: pip install vllm (README, 'vLLM rollouts')"
        ) from None


def merged_state_dict(model, base_only: bool = False) -> dict:
    """The full weights a plain (non-LoRA) copy of `model` would have, all at once (tests and small tools; the engines
    stream them: common.parallel.weight_stream.engine_weights). Names without peft's prefixes."""
    return dict(engine_weights(model, None, base_only))


def adapter_only(model) -> bool:
    """A peft LoRA model whose adapter alone can go to vLLM: no `modules_to_save` (whole modules: they need the
    merged route) and no DoRA (vLLM has no DoRA kernels)."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover
        return False
    if not isinstance(model, PeftModel):
        return False
    cfg = model.peft_config["default"]
    return not getattr(cfg, "modules_to_save", None) and not getattr(cfg, "use_dora", False)


class AdapterPush:
    """--vllm-lora-sync adapter (both vLLM engines): the LoRA adapter alone, a few MB, as a folder vLLM loads (peft's
    adapter_model.safetensors + adapter_config.json), one folder and one adapter name per version, so a rollout
    finishes under the adapter it started with. The frozen base goes once, by the full route, at the first push."""

    def __init__(self, root: Path):
        self.root, self.fingerprint, self.version, self.base_pushed = root, None, 0, False

    def prepare(self, model, force: bool = False, write: bool = True) -> Path | None:
        """The next version's folder, written (`write`: the process that pushes) if the adapter changed since the
        last push (every process computes the fingerprint: it gathers under FSDP2), else None."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file
        from torch.distributed.tensor import DTensor

        fingerprint = trainable_fingerprint(model)  # the adapters are what trains
        if not force and self.fingerprint is not None and torch.equal(fingerprint, self.fingerprint):
            return None
        self.version, self.fingerprint = self.version + 1, fingerprint
        folder = self.root / f"adapter_v{self.version}"
        # the adapter's tensors only (a few MB), gathered one at a time; never model.state_dict() (FSDP2 reshards)
        sd = {
            k: v.full_tensor() if isinstance(v, DTensor) else v.data
            for k, v in model.named_parameters()
            if ".lora_" in k
        }
        if write:
            folder.mkdir(parents=True, exist_ok=True)
            tensors = get_peft_model_state_dict(model, state_dict=sd)
            tensors = {k: v.detach().float().cpu().contiguous() for k, v in tensors.items()}
            save_file(tensors, str(folder / "adapter_model.safetensors"))
            model.peft_config["default"].save_pretrained(str(folder))
        return folder

    def bytes(self) -> int:
        return (self.root / f"adapter_v{self.version}" / "adapter_model.safetensors").stat().st_size

    def forget_before(self, keep: int = 2) -> None:
        """Remove the folders of versions older than the last `keep` (vLLM has loaded them)."""
        import shutil

        for v in range(max(1, self.version - 8), self.version - keep + 1):
            shutil.rmtree(self.root / f"adapter_v{v}", ignore_errors=True)


def lora_rank_for_vllm(r: int) -> int:
    """vLLM's --max-lora-rank takes 1, 8, 16, 32, ...: the smallest that holds rank r."""
    return next(x for x in (1, 8, 16, 32, 64, 128, 256, 320, 512) if x >= r)


def _check_cpu_head_size(model_path: str, trust_remote_code: bool) -> None:
    """vLLM's CPU attention runs only some head sizes; say so before the engine starts (its own error is a
    RuntimeError deep in its start-up: 'Unsupported CPU attention configuration: head_dim=16')."""
    from transformers import AutoConfig

    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = CPUAttentionBackend.get_supported_head_sizes()
    except Exception:  # another vLLM layout: its own start-up check applies
        return
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    config = getattr(config, "text_config", None) or config
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if head_dim and head_dim not in supported:
        raise UserError(
            f"--rollout-engine vllm: vLLM's CPU attention supports head sizes {supported}; {model_path} has "
            f"{head_dim} (hidden {config.hidden_size} / {heads} heads); use --rollout-engine hf"
        )


def weights_fingerprint(state_dict: dict) -> torch.Tensor:
    """(n tensors, 2) float64 on CPU: each tensor's sum and sum of squares, in name order. Equal fingerprints:
    the same weights, for any change an optimizer makes (a step that kept every tensor's sum and sum of squares
    is not one that happens); computed where the weights live, one small copy back."""
    rows = [sum_and_squares(t) for _, t in sorted(state_dict.items())]
    return torch.stack(rows).cpu() if rows else torch.zeros(0, 2, dtype=torch.float64)


def as_generation(queries, ids: list[list[int]], logprobs: list[list[float]], stopped: list[bool], max_new_tokens: int,
                  tok, sampled: bool):  # fmt: skip
    """An engine's answers (each row's sampled ids, their log-probs, whether a stop string ended it) as the
    `Generation` of common.core.generation.generate: responses right-padded to the longest, masks, EOS/truncation flags,
    the sampler's log-probs (None when greedy)."""
    from common.core.generation import Generation, response_masks

    B, T = len(ids), max(1, max(len(r) for r in ids))
    responses = torch.full((B, T), tok.pad_token_id, dtype=torch.long)
    lp = torch.zeros(B, T)
    for i, (r, l) in enumerate(zip(ids, logprobs)):
        responses[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        lp[i, : len(l)] = torch.tensor(l, dtype=torch.float32)
    device = queries.device
    responses, lp = responses.to(device), lp.to(device)
    stops = torch.tensor(stopped, dtype=torch.bool, device=device)
    mask, is_eos, lengths = response_masks(responses, stop_ids(tok), tok.pad_token_id, stops)
    truncated = (lengths == max_new_tokens) & ~is_eos & ~stops
    return Generation(
        torch.cat([queries, responses], 1), responses, mask, is_eos, truncated, lp * mask if sampled else None
    )


class VLLMEngine:
    """A colocated vLLM engine for one policy: `sync(model)` then `generate(...)`."""

    def __init__(
        self,
        model_path: str,
        tok,
        max_model_len: int | None,
        seed: int,
        dtype: torch.dtype = torch.float32,
        gpu_memory_utilization: float = 0.3,
        kv_cache_gb: float = 1.0,
        tensor_parallel_size: int = 1,
        sleep: bool = False,
        trust_remote_code: bool = False,
        lora_rank: int = 0,
        enforce_eager: bool | None = None,
    ):
        require_vllm()
        cuda = torch.cuda.is_available()
        # eager (no CUDA graphs, no compile) by default on CPU only: on GPUs graphs decode 1.5-3x faster
        enforce_eager = (not cuda) if enforce_eager is None else enforce_eager
        if sleep and not cuda:
            raise UserError(
                "--vllm-sleep frees GPU memory during the update: it needs a GPU (vLLM's CPU backend has no sleep mode)"
            )
        if tensor_parallel_size > 1 and not cuda:
            raise UserError("--vllm-tensor-parallel-size > 1 needs GPUs (one engine over several devices)")
        dist = torch.distributed
        multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if tensor_parallel_size > 1 and multi:
            # with one engine per training process, the ranks of a TP group would have to pass identical
            # prompts to vLLM (TRL gathers them); the scripts give each rank its own share
            raise UserError(
                "--vllm-tensor-parallel-size > 1 works with one training process (the engine spans the GPUs); "
                "under accelerate launch with several processes use 1 (each process has its own engine)"
            )
        # in this process: weight sync passes tensors by reference, and no second process holds a copy
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if not cuda:  # the CPU backend's KV cache size (GPUs: gpu_memory_utilization)
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(kv_cache_gb)))))
        if not cuda:
            _check_cpu_head_size(model_path, trust_remote_code)
        from vllm import LLM

        kw = {}
        if multi:
            # one engine per training process, in the process group the launcher made (as TRL's colocate mode)
            kw["distributed_executor_backend"] = "external_launcher"
        self.tok, self.dtype = tok, dtype
        self.fingerprint = None  # trainable_fingerprint of the weights pushed last (None: never synced)
        self.in_phase = False  # inside a rollout phase (`begin_phase`): synced and awake until it ends
        self.wakes = 0  # --vllm-sleep: times woken (once per rollout phase: a step's sampling, an evaluation)
        try:
            self.llm = LLM(
                model=model_path,
                tokenizer=model_path,
                dtype=dtype,
                seed=seed,
                max_model_len=max_model_len,
                enforce_eager=enforce_eager,
                gpu_memory_utilization=gpu_memory_utilization,
                tensor_parallel_size=tensor_parallel_size,
                enable_sleep_mode=sleep,
                logprobs_mode="processed_logprobs",
                generation_config="vllm",
                trust_remote_code=trust_remote_code,
                **kw,
                **(
                    dict(enable_lora=True, max_lora_rank=lora_rank_for_vllm(lora_rank), max_loras=2)
                    if lora_rank
                    else {}
                ),
            )
        except Exception as e:  # vLLM's own refusal (an architecture it cannot load, memory, ...): one line
            first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
            raise UserError(
                f"--rollout-engine vllm: vLLM could not start an engine for {model_path} ({type(e).__name__}: "
                f"{first[:300]}); use --rollout-engine hf (CLEANRLHF_DEBUG=1 shows vLLM's traceback)"
            ) from e
        self.sleep, self.asleep = sleep, set()  # asleep: the parts released
        # --vllm-lora-sync adapter: the adapter alone goes to the engine (a LoRARequest per version)
        self.adapters = AdapterPush(Path(tempfile.mkdtemp(prefix="cleanrlhf-adapters-"))) if lora_rank else None
        self.lora_request = None
        self._log_kv_cache(cuda, gpu_memory_utilization)
        self._sleep()

    def _log_kv_cache(self, cuda: bool, share: float) -> None:
        """One line at start: what the engine holds for the KV cache (GPU: what --vllm-gpu-memory-utilization left
        after its weights), so the share can be chosen from a number rather than guessed."""
        try:
            cfg = self.llm.llm_engine.vllm_config.cache_config
            blocks, size = cfg.num_gpu_blocks, cfg.block_size
        except Exception:  # another vLLM layout: nothing to say
            return
        if blocks:
            where = f"--vllm-gpu-memory-utilization {share:g}" if cuda else "--vllm-kv-cache-gb"
            print(f"[cleanrlhf] vllm engine: KV cache of {blocks * size} tokens ({blocks} blocks; {where})", flush=True)

    def _sleep(self):
        """--vllm-sleep (GPU): level 2, weights and KV cache released (the weights are pushed again at the wake)."""
        if self.sleep and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = {"weights", "kv_cache"}
            self.fingerprint = None  # the engine's weights are gone: the next phase pushes them
            if self.adapters is not None:
                self.adapters.base_pushed, self.adapters.fingerprint = False, None

    def _wake(self, tags: list[str] | None = None):
        """Wake the parts in `tags` ("weights", "kv_cache"; None: both) that are asleep."""
        want = set(tags or ("weights", "kv_cache")) & self.asleep
        if not want:
            return
        self.wakes += "weights" in want
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # what the update freed goes back before vLLM allocates again
        self.llm.wake_up(tags=sorted(want))
        self.asleep -= want

    def _awake_for_a_call(self) -> None:
        """generate/score: inside a phase the engine is awake; outside one (a sleeping engine called directly) its
        weights were discarded at level 2, so a call without `begin_phase` would sample from garbage."""
        if "weights" in self.asleep:
            raise RuntimeError("VLLMEngine asleep (--vllm-sleep): generate inside begin_phase(model) / end_phase()")
        self._wake(["kv_cache"])

    def take_wakes(self) -> int:
        """Wakes since the last call (perf/vllm_wakes)."""
        n, self._wakes_taken = self.wakes - getattr(self, "_wakes_taken", 0), self.wakes
        return n

    def begin_phase(self, model) -> None:
        """A rollout phase starts (common.parallel.sharded.unwrap_for_generation): woken once (weights first, then the
        push into them, then the KV cache: TRL's order, so the push never competes with the cache for memory) and
        synced once; every generate call until `end_phase` uses the engine as it is."""
        self._wake(["weights"])
        self.sync(model)
        self._wake(["kv_cache"])
        self.in_phase = True

    def end_phase(self) -> None:
        """The phase ended: asleep under --vllm-sleep until the next one."""
        self.in_phase = False
        self._sleep()

    @torch.no_grad()
    def sync(self, model, force: bool = False) -> bool:
        """Push `model`'s current weights into the engine if they differ from the last push. `model`: the policy as it
        rests (sharded under FSDP2 / ZeRO-3: `engine_weights` gathers one tensor at a time). Returns whether it
        pushed. Inside a rollout phase (`begin_phase`) the phase's push stands: nothing is read again.

        "Differ" is decided from the weights themselves (`trainable_fingerprint`), not from how they were written:
        DeepSpeed ZeRO-1/2 steps its own flat float32 partitions and copies them into the module, ZeRO-3 re-gathers
        them, a fused AdamW writes without bumping tensor versions (issue 32.2). Cost: one read of this rank's
        trainable shards per rollout phase and one all-reduce of (n, 2) numbers; nothing gathered when unchanged."""
        if self.in_phase and not force:
            return False
        if self.adapters is not None and adapter_only(model):
            return self._sync_adapter(model, force)
        fingerprint = trainable_fingerprint(model)
        if not force and self.fingerprint is not None and torch.equal(fingerprint, self.fingerprint):
            return False
        self.lora_request = None
        self._wake(["weights"])
        self._reload(engine_weights(model, self.dtype))
        self.llm.reset_prefix_cache()  # cached prompt KV came from the old weights
        self.fingerprint = fingerprint
        return True

    def _reload(self, weights) -> None:
        """vLLM's in-place reload from a stream of (name, tensor): consumed one tensor at a time in this process. With
        worker processes (--vllm-tensor-parallel-size > 1) the argument is pickled: a list then (the whole model in
        host memory for the push; docs/distributed.md)."""
        several = getattr(self.llm.llm_engine.vllm_config.parallel_config, "tensor_parallel_size", 1) > 1
        weights = [(k, v.cpu()) for k, v in weights] if several else weights
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})

    def _sync_adapter(self, model, force: bool) -> bool:
        """The base once (full route, adapters off), then each changed adapter as a new LoRARequest."""
        from vllm.lora.request import LoRARequest

        if not self.adapters.base_pushed:
            self._wake(["weights"])
            self._reload(engine_weights(model, self.dtype, base_only=True))
            self.adapters.base_pushed = True
        folder = self.adapters.prepare(model, force)
        if folder is None:
            return False
        v = self.adapters.version
        self.lora_request = LoRARequest(f"v{v}", v, str(folder))
        self.llm.reset_prefix_cache()
        self.adapters.forget_before()
        return True

    def generate(
        self,
        queries: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seeds: list[int] | None = None,
        stop_strings: list[str] | None = None,
    ):
        """Same contract as `common.core.generation.generate`: (B, P) left-padded queries -> `Generation`, responses
        right-padded to the longest, greedy when seeds is None."""
        from vllm import SamplingParams

        tok = self.tok
        prompts = [{"prompt_token_ids": q[m.bool()].tolist()} for q, m in zip(queries.cpu(), attention_mask.cpu())]
        common = dict(
            max_tokens=max_new_tokens,
            logprobs=0,  # the sampled token's own log-prob
            stop=stop_strings or None,
            include_stop_str_in_output=True,  # as the hf engine: the stop string's tokens stay in the response
            stop_token_ids=stop_ids(tok),
            skip_special_tokens=True,
            detokenize=bool(stop_strings),  # stop strings are matched on text
        )
        if seeds is None:
            params = SamplingParams(temperature=0.0, **common)
        else:
            params = [
                SamplingParams(temperature=temperature, top_k=top_k if top_k > 0 else -1, top_p=top_p, seed=s, **common)
                for s in seeds
            ]
        self._awake_for_a_call()
        outs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        ids, lps, stopped = [], [], []
        for o in outs:
            c = o.outputs[0]
            ids.append(list(c.token_ids))
            lps.append([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)] if c.logprobs is not None else [])
            stopped.append(isinstance(c.stop_reason, str))  # ended by a stop string
        return as_generation(queries, ids, lps, stopped, max_new_tokens, tok, sampled=seeds is not None)

    def score(self, queries, query_mask, responses, response_mask, top_k: int):
        """A served teacher: vLLM's prompt log-probs of each (query, response), at temperature 1 (the engine's own
        weights: it is not synced). Returns, per response position, (B, T) the response token's log-prob and
        (B, T, k) the k most likely tokens' log-probs and (B, T, k) their ids; 0 past each response's end."""
        from vllm import SamplingParams

        B, T = responses.shape
        seqs = [q[qm.bool()].tolist() + r[rm.bool()].tolist()
                for q, qm, r, rm in zip(queries.cpu(), query_mask.cpu(), responses.cpu(), response_mask.cpu())]  # fmt: skip
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=top_k, detokenize=False)
        self._awake_for_a_call()
        outs = self.llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
        token_lp, top_lp, top_ids = (
            torch.zeros(B, T),
            torch.zeros(B, T, top_k),
            torch.zeros(B, T, top_k, dtype=torch.long),
        )
        for i, (o, seq) in enumerate(zip(outs, seqs)):
            start = int(query_mask[i].sum())  # prompt_logprobs[j]: the log-probs that predicted seq[j] (None at 0)
            for j in range(len(seq) - start):
                ranked = sorted(o.prompt_logprobs[start + j].items(), key=lambda kv: kv[1].rank)  # the token, top-k
                token_lp[i, j] = o.prompt_logprobs[start + j][seq[start + j]].logprob
                top = [kv for kv in ranked if kv[1].rank <= top_k][:top_k]
                top_ids[i, j] = torch.tensor([t for t, _ in top])
                top_lp[i, j] = torch.tensor([lp.logprob for _, lp in top])
        device = queries.device
        return token_lp.to(device), top_lp.to(device), top_ids.to(device)
