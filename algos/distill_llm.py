"""On-policy distillation: the student samples its own responses, a frozen teacher grades every token of them.

Docs: docs/algos/distill.md. Agarwal et al. 2024 "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes" (GKD); Thinking Machines 2025 "On-Policy Distillation" (the per-token reverse KL as the
advantage, as prime-rl's opd); verl's top-k forward KL. The student learns from its own mistakes with a dense
signal (one number per token, not one per answer): RL's on-policy data at roughly SFT's cost per token.

Each step samples `num_prompts` prompts, `samples_per_prompt` responses each, from the student (the hf or the vllm
engine), runs the teacher once over the sampled tokens and takes one optimizer step on a per-token divergence
between student and teacher on exactly those tokens (--loss). With probability 1 - lmbda a step trains on the
data's reference responses instead (GKD's lambda: off-policy distillation, i.e. SFT toward the teacher's grades).

    python algos/distill_llm.py --teacher runs/grpo_llm__.../checkpoints/step_200/policy   # student: SmolLM2-135M
    python algos/distill_llm.py --teacher T --loss gkd --beta 0.5          # GKD's generalized JSD, full vocabulary
    python algos/distill_llm.py --teacher T --loss reverse-kl-pg           # sampled-token reverse KL as advantage
    python algos/distill_llm.py --teacher T --loss topk-fkl --teacher-top-k 16     # verl's top-k forward KL
    python algos/distill_llm.py --teacher T --lmbda 0.5 --lora-r 16         # half the steps off-policy; LoRA student
    accelerate launch --multi_gpu --num_processes 2 algos/distill_llm.py --teacher T

Legend: N prompts per rank, S samples per prompt, B = N*S sequences, P prompt length, T response length,
        V vocabulary; b, t: rows of one micro-batch and its longest response.
"""

import math
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # so `common` imports from a plain `python algos/...`

# fmt: off
import torch
import torch.nn.functional as F

from common.core import chat
from common.core.data import Sampler
from common.core.errors import UserError
from common.core.forwards import micro_batches
from common.core.generation import generate, response_masks, tokenize_queries
from common.core.generation import position_ids_from_mask, sequence_attention_mask
from common.core import models as M
from common.core.ops import all_sum, exact_div, global_mean_divisor
from common.core.seeds import mix_seed, seed_everything
from common.core.tasks import load_rl_prompts
from common.parallel.accelerator import configure_deepspeed, make_accelerator
from common.parallel.optim import adamw
from common.parallel.sharded import UpdateGuard, backward, prepare_frozen, unwrap_for_generation
from common.integrations.engines import engine_perf, frozen_engine, make_engine
from common.integrations.inputs import reward_from_args
from common.harness.args import GenerationArgs, Group, ModelArgs, OptimArgs, PositiveInt, PromptArgs, RewardArgs, RunArgs, UnitFloat, group
from common.harness.cli import cli
from common.harness.eval import evaluate_policy
from common.harness.perf import peak_mem_gb
from common.harness.run import Run
# fmt: on


@dataclass
class Args:
    # --- algorithm
    teacher: Optional[str] = None
    """the teacher: a causal LM folder (a checkpoint's policy folder) or hub id, with the student's tokenizer"""
    loss: Literal["gkd", "reverse-kl-pg", "topk-fkl"] = "gkd"
    """gkd: GKD's divergence over the vocabulary (--beta; 1, the default: the exact per-token reverse KL);
    reverse-kl-pg: the sampled token's reverse KL as a per-token advantage (Thinking Machines, prime-rl: needs
    only the teacher's log-prob of each sampled token); topk-fkl: forward KL on the teacher's top-k tokens (verl)"""
    beta: UnitFloat = 1.0
    """gkd: 0 forward KL(teacher || student), 1 reverse KL(student || teacher), between: the generalized JSD"""
    teacher_top_k: PositiveInt = 16
    """topk-fkl: the teacher's tokens per position the divergence sums over"""
    topk_renormalise: bool = False
    """topk-fkl: renormalise the teacher's top-k probabilities to sum to 1 (the same optimum; each position's gradient
    divided by its top-k mass). Off (the default): the teacher's probabilities as they are, as verl does"""
    teacher_engine: Literal["hf", "vllm"] = "hf"
    """hf: the teacher in this process (placed like a reference model); vllm: served by a vLLM engine of its own,
    which returns its prompt log-probs of the sampled tokens and its top-k (for a teacher too large to hold here;
    --loss reverse-kl-pg or topk-fkl, temperature 1; train/kl is then the sampled-token estimate)"""
    lmbda: UnitFloat = 1.0
    """GKD's lambda: the share of steps trained on the student's own samples; the others use the data's reference
    responses (extra_info.response, else reward_model.ground_truth). reverse-kl-pg's off-policy steps take the exact
    reverse KL over the vocabulary (its sampled-token form holds only on the student's own samples)"""
    num_prompts: PositiveInt = 16
    """prompts per step, over all processes"""
    samples_per_prompt: PositiveInt = 1
    """S: responses the student samples per prompt"""
    micro_batch_size: PositiveInt = 8
    """sequences per forward/backward on one process"""

    # --- the flags every script shares (common/harness/args.py), flat: --seed, --model-name-or-path, ...
    run: Group[RunArgs] = group(RunArgs, exp_name=Path(__file__).stem, total_steps=100)
    model: Group[ModelArgs] = group(ModelArgs)
    data: Group[PromptArgs] = group(PromptArgs)
    rewards: Group[RewardArgs] = group(RewardArgs)
    gen: Group[GenerationArgs] = group(GenerationArgs)
    optim: Group[OptimArgs] = group(OptimArgs, learning_rate=1e-5)


# ALGO LOGIC: the per-token divergences (--loss); student and teacher logits at the sampling temperature
def reverse_kl_pg_loss(logprobs, teacher_logprobs, mask):
    """The sampled token's reverse-KL estimate k1 = log pi_S(y_t) - log pi_T(y_t) as a per-token advantage
    A_t = -sg(k1) (discount 0), in the policy-gradient form l_t = -(A_t - b_t) log pi_S(y_t). Over y ~ pi_S its
    gradient is that of KL(pi_S || pi_T) at each position: E[(log pi_S - log pi_T) grad log pi_S] (the score
    function has mean 0 given y_<t, so a b_t that depends only on y_<t changes nothing in expectation).
    b_t: the mean advantage of the same response's earlier tokens (0 at its first), a baseline: without one the mean
    of A is -KL, which pushes every sampled token down (Thinking Machines uses none, with large batches). Per response, so the loss does not depend on how the batch is
    cut into micro-batches. Needs only the teacher's log-prob of each sampled token. (b, t) each -> (loss, A)."""
    advantage = (teacher_logprobs - logprobs).detach() * mask  # (b, t)
    earlier = (mask.cumsum(1) - mask).clamp(min=1)  # (b, t) real tokens before t
    baseline = (advantage.cumsum(1) - advantage) / earlier  # (b, t)
    return -(advantage - baseline) * logprobs, advantage


def generalized_jsd(student_logits, teacher_logits, beta):
    """GKD's divergence per position over the whole vocabulary, p_S = softmax(student), p_T = softmax(teacher):
      beta = 0   KL(p_T || p_S)   forward (mode-covering; SFT on the teacher's distribution)
      beta = 1   KL(p_S || p_T)   reverse (mode-seeking; what on-policy distillation minimises)
      else       beta KL(p_T || m) + (1 - beta) KL(p_S || m),  m = beta p_T + (1 - beta) p_S
    (the JSD tends to 0 at either end, so the ends are the KLs themselves, as in TRL). (b, t, V) x2 -> (b, t)."""
    ls, lt = F.log_softmax(student_logits.float(), -1), F.log_softmax(teacher_logits.float(), -1)

    def kl(lp, lq):  # KL(p || q) from log-probs (b, t, V) -> (b, t)
        return (lp.exp() * (lp - lq)).sum(-1)

    if beta == 0:
        return kl(lt, ls)
    if beta == 1:
        return kl(ls, lt)
    lm = torch.logsumexp(torch.stack([lt + math.log(beta), ls + math.log(1 - beta)]), 0)  # (b, t, V) log m
    return beta * kl(lt, lm) + (1 - beta) * kl(ls, lm)


def topk_forward_kl(student_logits, top, index, renormalise=False):
    """verl's top-k forward KL: the teacher's k most likely tokens (`index`, their log-probs `top`: q_k) against the
    student's log-probs of them: sum_k q_k (log q_k - log p_S(k)), least when p_S(k) = q_k / sum_k q_k (all of the
    student's mass on the top-k). renormalise: q divided by its mass first (the same optimum, where the loss is 0;
    each position's gradient divided by its top-k mass). Only k numbers per position come from the teacher (what a
    served teacher returns). (b, t, V), (b, t, k) x2 -> (b, t)."""
    lq = top - torch.logsumexp(top, -1, keepdim=True) if renormalise else top  # (b, t, k)
    ls = F.log_softmax(student_logits.float(), -1).gather(-1, index)  # (b, t, k)
    return (lq.exp() * (lq - ls)).sum(-1)


def token_divergence(args, on_policy, logits, index, mask, teacher_logits, t_token, t_top, t_index):
    """--loss per token on one micro-batch: (b, t). reverse-kl-pg's score-function form is the reverse KL's gradient
    only on the student's own samples: an off-policy step (the data's responses, --lmbda < 1) takes the exact reverse
    KL over the vocabulary (gkd at beta 1), which it estimates."""
    if args.loss == "reverse-kl-pg" and on_policy:
        return reverse_kl_pg_loss(F.log_softmax(logits, -1).gather(-1, index)[..., 0], t_token, mask)[0]
    if args.loss == "topk-fkl":
        return topk_forward_kl(logits, t_top, t_index, args.topk_renormalise)
    return generalized_jsd(logits, teacher_logits, args.beta if args.loss == "gkd" else 1.0)


def response_logits(model, query_responses, attention_mask, P, temperature, V=None):
    """The logits that predicted each response token, divided by the temperature, float32: (b, t, V), the first V
    rows of the head (a teacher's vocabulary padded past the student's: rows of no token of the shared tokenizer)."""
    T = query_responses.shape[1] - P
    kw = dict(position_ids=position_ids_from_mask(attention_mask), logits_to_keep=T + 1, use_cache=False)
    logits = model(input_ids=query_responses, attention_mask=attention_mask, **kw).logits[:, :-1, :V]
    return logits.float() / temperature


def reference_text(row):
    """A row's reference response (--lmbda < 1): extra_info.response, else its ground truth; None when it has none."""
    text = row.extra_info.get("response", row.ground_truth)
    return None if text is None or not str(text).strip() else text


def reference_responses(tok, rows, device):
    """Off-policy steps (--lmbda < 1): each row's reference response (extra_info.response, else its ground truth)
    with EOS, right-padded. Returns (responses (B, T), mask (B, T))."""
    texts = [str(reference_text(x)) for x in rows]
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [chat.turn_end_id(tok)] for t in texts]
    T = max(len(x) for x in ids)
    responses = torch.tensor([x + [tok.pad_token_id] * (T - len(x)) for x in ids], device=device)  # (B, T)
    return responses, response_masks(responses, chat.stop_ids(tok), tok.pad_token_id)[0]


def main(args: Args):
    # ------------------------------------------------------------------ setup  # TRY NOT TO MODIFY
    if not args.teacher:
        raise UserError("--teacher: required (a causal LM folder, e.g. a checkpoint's policy folder, or a hub id)")
    accelerator = make_accelerator(args.model)  # as launched: DDP, FSDP2, DeepSpeed; --mixed-precision
    device, W, S = accelerator.device, accelerator.num_processes, args.samples_per_prompt
    local_num_prompts = exact_div(args.num_prompts, W, "--num-prompts over the number of processes")
    local_batch = local_num_prompts * S
    exact_div(
        local_batch, args.micro_batch_size, "--num-prompts x --samples-per-prompt per process over --micro-batch-size"
    )
    configure_deepspeed(
        accelerator, args.micro_batch_size, local_batch // args.micro_batch_size, args.optim.max_grad_norm
    )
    seed_everything(args.run.seed)
    run = Run(accelerator, args, Path(__file__).stem)  # --resume: resolved and checked before anything loads
    max_len = args.data.max_prompt_length + args.gen.max_new_tokens
    tok = chat.prompt_tokenizer(args.model, args.data, max_len, "--max-prompt-length + --max-new-tokens")
    chat.check_same_tokenizer(tok, args.teacher, "--teacher", args.model.trust_remote_code)  # before any weights load
    # a head padded past the shared tokenizer (the padding differs between sizes of a family): both cut to the smaller
    V = min(chat.vocab_rows(p, args.model.trust_remote_code) for p in (args.model.model_name_or_path, args.teacher))
    if V < len(tok):
        raise UserError(f"--teacher {args.teacher} or the student: a head of {V} rows for a tokenizer of {len(tok)}")
    reward = reward_from_args(args.rewards, args.model, args.gen.max_new_tokens, accelerator)  # eval, train/reward
    train_rows, val_rows = load_rl_prompts(args.data, tok, reward, accelerator.print)
    missing = [x.uid for x in train_rows if reference_text(x) is None] if args.lmbda < 1 else []
    if missing:  # an off-policy step would train toward an empty answer
        raise UserError(
            f"--lmbda {args.lmbda} trains on the data's reference responses, and {len(missing)} training rows have "
            f"none (e.g. row {missing[0]}): give extra_info.response or a ground truth, or --lmbda 1"
        )
    sampler = Sampler(len(train_rows), args.run.seed)

    # ALGO LOGIC: the student (trained) and the teacher (frozen, placed and sharded like a reference model)
    policy = M.load_causal_lm(args.model.model_name_or_path, tok, **M.train_kwargs(args.model))
    if args.teacher_engine == "hf":  # frozen, its forwards in accelerator.autocast()
        teacher = M.load_causal_lm(args.teacher, tok, **M.frozen_kwargs(args.model))
        teacher = prepare_frozen(accelerator, teacher, under_autocast=True)
    else:  # served: its own weights, never synced; the k log-probs per position that topk-fkl needs
        if args.loss == "gkd" or args.gen.temperature != 1 or (args.loss == "reverse-kl-pg" and args.lmbda < 1):
            raise UserError(
                "--teacher-engine vllm returns log-probs at temperature 1 for k tokens per position: use "
                "--loss reverse-kl-pg (with --lmbda 1) or topk-fkl with --temperature 1 (gkd, and reverse-kl-pg's "
                "off-policy steps, need the whole vocabulary)"
            )
        teacher = frozen_engine(args.gen, args.model, args.teacher, tok, max_len, args.run.seed)  # its own weights
    opt, sched = adamw(policy, args.optim, args.run.total_steps)

    # ------------------------------------------------------- checkpoint state, run folder  # TRY NOT TO MODIFY
    guard = UpdateGuard(accelerator)  # non-finite gradients: step skipped, never NaN weights
    run.load_weights(policy=policy)  # resumed: the checkpoint's weights
    policy, opt, sched = accelerator.prepare(policy, opt, sched)
    engine = make_engine(args.gen, args.model, tok, policy, accelerator, max_len, args.run.seed)  # vllm, or None
    T_max = args.gen.max_new_tokens  # the response length limit
    evaluate = partial(  # greedy on --val-files
        evaluate_policy, accelerator, policy, tok, reward, val_rows, T_max, args.micro_batch_size, engine
    )
    # what a checkpoint holds, by name (restored here when resuming); evaluation before the first step
    state = dict(sched=sched, sampler=sampler, guard=guard)
    run.begin(tok, {"policy": policy}, {"opt": ("policy", opt)}, state, evaluate=evaluate if val_rows else None)
    temperature = args.gen.temperature

    for step in run.steps():  # after each: checkpoints (periodic, final, on a signal), --max-wall-minutes
        # ------------------------------------------------------------------ 1. rollout: the student's own samples
        t_step = time.time()
        r = accelerator.process_index
        ids = sampler.take(args.num_prompts)[r * local_num_prompts : (r + 1) * local_num_prompts]  # this rank's
        rows = [train_rows[i] for i in ids for _ in range(S)]  # (B,) a prompt's samples adjacent
        queries, query_mask = tokenize_queries(tok, [x.text for x in rows], device)  # (B, P)
        # GKD's lambda: the same draw on every rank (seeded by step), so all ranks take the same kind of step
        on_policy = (
            torch.rand((), generator=torch.Generator().manual_seed(mix_seed(args.run.seed, step, -1))) < args.lmbda
        )
        if on_policy:
            seeds = [mix_seed(args.run.seed, step, r * local_batch + j) for j in range(len(rows))]
            with unwrap_for_generation(accelerator, policy, engine) as gen_model:
                rollout = generate(
                    gen_model, tok, queries, query_mask, **args.gen.sampling(), seeds=seeds, engine=engine
                )
            responses, mask = rollout.responses, rollout.response_mask  # (B, T) each
        else:  # off-policy: the data's reference responses
            responses, mask = reference_responses(tok, rows, device)
        gen_s = time.time() - t_step
        texts = tok.batch_decode(responses, skip_special_tokens=True)
        scores = reward(rows, texts, mask.sum(1), device)[0]  # (B,) monitored, not trained on
        P, T = queries.shape[1], responses.shape[1]
        query_responses = torch.cat([queries, responses], 1)  # (B, P+T)
        attn = sequence_attention_mask(query_mask, T)  # (B, P+T)
        # a served teacher: (B, T) the sampled tokens' log-probs, (B, T, k) x2 its top-k log-probs and token ids
        served = (
            teacher.score(queries, query_mask, responses, mask, args.teacher_top_k)
            if args.teacher_engine == "vllm"
            else None
        )

        # ------------------------------------------------------------------ 2. teacher grades, 3. update
        t_train, n_tokens = time.time(), global_mean_divisor(mask.sum())  # token-mean over all ranks' tokens
        stats = {k: torch.zeros((), device=device) for k in ("loss", "kl", "ent", "kl_first", "kl_last")}
        micros = micro_batches(list(range(len(rows))), query_mask, mask, args.micro_batch_size, 0, accelerator)
        for k, m in enumerate(micros):
            micro, cut = m.ids, slice(P - m.p, P + m.t)
            qr, am, m_mask = query_responses[micro, cut], attn[micro, cut], mask[micro, : m.t]  # (b, p+t), (b, t)
            index = qr[:, m.p :, None]  # (b, t, 1) the sampled tokens
            teacher_logits = t_top = t_index = None  # what the --loss reads, below
            if served is None:
                with torch.no_grad(), accelerator.autocast():
                    teacher_logits = response_logits(teacher, qr, am, m.p, temperature, V)  # (b, t, V)
                    teacher_lp = F.log_softmax(teacher_logits, -1)  # (b, t, V)
                t_token = teacher_lp.gather(-1, index)[..., 0]  # (b, t)
                if args.loss == "topk-fkl":  # (b, t, k) x2, only for the loss that reads them
                    t_top, t_index = teacher_lp.topk(args.teacher_top_k)
            else:
                t_token, t_top, t_index = (x[micro, : m.t] for x in served)  # (b, t), (b, t, k) x2
            with accelerator.autocast():
                logits = response_logits(policy, qr, am, m.p, temperature, V)  # (b, t, V)
            token_loss = token_divergence(
                args, on_policy, logits, index, m_mask, teacher_logits, t_token, t_top, t_index
            )
            loss = (token_loss * m_mask).sum() / n_tokens
            backward(accelerator, policy, loss, last=k == len(micros) - 1)
            with (
                torch.no_grad()
            ):  # the reverse KL per token (exact over the vocabulary; served: the sampled k1), entropy
                ls = F.log_softmax(logits, -1)  # (b, t, V)
                kl = (
                    (ls.exp() * (ls - teacher_lp)).sum(-1) if served is None else ls.gather(-1, index)[..., 0] - t_token
                )
                kl = kl * m_mask  # (b, t) KL(student || teacher), as gkd at beta 1
                ent = -(ls.exp() * ls).sum(-1) * m_mask  # (b, t)
                last = (m_mask.sum(1).long() - 1).clamp(min=0)  # (b,) each row's last real token
                stats["kl_first"] += kl[:, 0].sum()
                stats["kl_last"] += kl.gather(1, last[:, None]).sum()
                for key, v in (("loss", loss * n_tokens), ("kl", kl.sum()), ("ent", ent.sum())):
                    stats[key] += v.detach()
        guard.step(policy, opt, args.optim.max_grad_norm, "policy", step)  # these: no-ops under DeepSpeed
        sched.step()
        opt.zero_grad()
        train_s = time.time() - t_train

        # ------------------------------------------------------------------ 4. log, evaluate, checkpoint
        if run.should_log(step):  # --log-every, and every evaluation step and the last
            tokens, seqs = all_sum(mask.sum()), len(rows) * W

            def per(key, n):  # a statistic summed over all processes, per token or per sequence
                return (all_sum(stats[key]) / n).item()

            all_scores, step_s = accelerator.gather(scores), time.time() - t_step
            metrics = {
                "train/reward": all_scores.mean().item(),
                "train/reward_std": all_scores.std().item() if all_scores.numel() > 1 else 0.0,
                "train/kl": per("kl", tokens),  # KL(student || teacher) per token
                "train/kl_first_token": per("kl_first", seqs),
                "train/kl_last_token": per("kl_last", seqs),
                "train/entropy": per("ent", tokens),
                "train/on_policy": float(on_policy),
                "train/response_len": accelerator.gather(mask.sum(1)).float().mean().item(),
                "train/lr": sched.get_last_lr()[0],
                "train/skipped_steps": guard.skipped,
                "loss/policy": per("loss", tokens),
                "loss/total": per("loss", tokens),
                **{"perf/step_s": step_s, "perf/gen_s": gen_s, "perf/train_s": train_s},
                **engine_perf(engine),
                "perf/tokens_per_s": tokens.item() / step_s,
                "perf/peak_mem_gb": peak_mem_gb(device),
            }
            samples = [
                {"prompt": x.text, "response": t, "reward": float(s), "split": "train" if on_policy else "reference"}
                for x, t, s in zip(rows, texts, scores)
            ]
            run.log(step, metrics, samples)  # + evaluation when due, health warnings, --save-best

    return run.end()


# a two-step run on a tiny model, as tests/scripts/test_smoke.py runs every script (and every copy) in algos/
SMOKE = (
    "--model-name-or-path {tiny} --teacher {tiny_peaky} --max-new-tokens 6 --num-eval-prompts 4 --num-prompts "
    "2 --samples-per-prompt 2 --micro-batch-size 2"
)


if __name__ == "__main__":
    cli(main, Args)  # parse flags and presets; a user error is one line and exit code 2
