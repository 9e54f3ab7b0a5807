"""Attention of short sequences in low precision: a transformers attention implementation (`SMALL_ATTENTION`)
that every loader in common.core.models swaps in where transformers chose SDPA; and the decoding loop's preallocated KV
cache (`preallocate_cache`)."""

import torch
from transformers.cache_utils import DynamicLayer

SMALL_ATTENTION = "cleanrlhf_sdpa"  # the name models are loaded with (common.core.models), registered below
SMALL_ATTENTION_MAX_SCORES = 192 * 192  # key x key positions up to which the plain matmul path runs (keys <= 192)


def exact_over_a_cache(k_len: int) -> bool:
    """A forward over a prompt cache (q < k) reproduces the full forward (q = k) of the same k positions bit for bit
    in bf16 only on the small path (its rows do not depend on q). SDPA's CPU kernel blocks the queries, so past the
    small path's size the two differ (~1e-3 in log-probs on a tiny model); callers run the full forward there."""
    return k_len * k_len <= SMALL_ATTENTION_MAX_SCORES


def small_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention function (AttentionInterface signature) = its SDPA one, except for bf16/fp16
    inputs with at most 192 key positions (SMALL_ATTENTION_MAX_SCORES = 192 x 192): there two matmuls.

    Why by hand: torch's CPU flash-attention kernel is slow in bf16 at RL's lengths. Measured on 2 cores
    (SmolLM2 shapes, 9 heads of 64 over 3 key/value heads, 30 layers): 32 prompts x 64 sampled tokens 7.6 s vs
    5.5 s; a policy forward + backward of 12 rows x 89 tokens 3.3 s vs 2.9 s with 0.04 GB less saved for
    backward (the probabilities are recomputed there, `_SmallAttention`, so the graph keeps q, k, v as SDPA's
    does); at 256 x 256 positions SDPA is faster again. The scores and the softmax are float32 (the query and
    key arrive in float32 under autocast; SDPA casts them to bf16 first): layer-0 weight gradients 6 % off
    float32's vs SDPA's 9 %. Float32 inputs are SDPA's, bit for bit.

    query: (B, H, q, d); key, value: (B, Hkv, k, d) (grouped-query: H = g * Hkv); attention_mask: bool
    (B, 1, q, k), True = attend (transformers' sdpa mask), or None = causal (q > 1, the query being the last
    q of the k positions, in a causal module) / everything (q = 1); a float mask, or None in a module that is
    not causal (an encoder), goes to SDPA. Returns ((B, q, H, d), None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len, k_len = query.shape[2], key.shape[2]
    device = query.device.type
    # a missing mask means "causal" only for a causal module (transformers' own rule); an encoder's (a RoBERTa
    # reward model's) unpadded batch also arrives without one, and is SDPA's
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    # under autocast the query and key arrive in float32 (rotary embedding in float32), and SDPA runs in bf16
    low = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else value.dtype
    if (
        low not in (torch.bfloat16, torch.float16)
        # by the keys alone: a row's full forward (q = k) and its forward over a prompt cache (q < k) must take the
        # same kernel, or pi_old from the cache differs from the update's log-probs before any step (issue 32.4)
        or k_len * k_len > SMALL_ATTENTION_MAX_SCORES
        or (dropout and module.training)
        or kwargs.get("s_aux") is not None  # attention sinks, soft-capping, position biases: SDPA's handling
        or kwargs.get("softcap") is not None
        or kwargs.get("position_bias") is not None
        or kwargs.get("cache") is not None
        or (attention_mask is not None and attention_mask.dtype != torch.bool)  # a custom additive mask
        or (attention_mask is None and q_len > 1 and not causal)  # bidirectional attention without a mask
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    (B, H, _, d), Hkv = query.shape, key.shape[1]
    scaling = d**-0.5 if scaling is None else scaling
    if attention_mask is None and q_len > 1:  # causal: query i (of the last q) sees keys <= its position
        attention_mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
    if attention_mask is not None and attention_mask.ndim == 4:  # (B, 1, q, k) -> (B, 1, 1, q, k)
        attention_mask = attention_mask.unsqueeze(1)
    # grouped-query heads without copying the keys/values: the g query heads of a key/value head side by side,
    # (B, H, q, d) -> (B, Hkv, g * q, d), head h = kv * g + i reading key/value head kv = h // g
    query = query.reshape(B, Hkv, (H // Hkv) * q_len, d)
    with torch.autocast(device, enabled=False):  # float32 scores (autocast would run their matmul in bf16)
        out = _SmallAttention.apply(query.float(), key.float(), value.to(low), attention_mask, scaling, H // Hkv)
    out = out.view(B, H, q_len, d)  # in bf16, as SDPA's under autocast
    return out.transpose(1, 2).contiguous(), None


class _SmallAttention(torch.autograd.Function):
    """softmax(q k^T * scaling, masked) @ v with the float32 probabilities recomputed in backward instead of
    saved, so the graph keeps q, k, v (as SDPA's does), not a (B, H, q, k) float32 and a bf16 copy of it.
    q: (B, Hkv, g * q, d) float32, k: (B, Hkv, k, d) float32, v: (B, Hkv, k, d) bf16, mask: bool broadcasting to
    (B, Hkv, g, q, k) or None. Returns (B, Hkv, g * q, d) in v's dtype."""

    @staticmethod
    def probs(q, k, mask, scaling, g):  # (B, Hkv, g * q, k) float32
        B, Hkv, gq, _ = q.shape
        scores = (q @ k.transpose(-1, -2)).mul_(scaling).view(B, Hkv, g, gq // g, k.shape[2])
        if mask is not None:  # finite minimum, not -inf: a fully masked row (left padding) gets finite garbage
            scores = scores.masked_fill_(~mask, torch.finfo(torch.float32).min)
        return torch.softmax(scores, -1).view(B, Hkv, gq, -1)

    @staticmethod
    def forward(ctx, q, k, v, mask, scaling, g):
        ctx.save_for_backward(q, k, v, mask)
        ctx.scaling, ctx.g = scaling, g
        return _SmallAttention.probs(q, k, mask, scaling, g).to(v.dtype) @ v

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, mask = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            p = _SmallAttention.probs(q, k, mask, ctx.scaling, ctx.g)  # as in the forward, bit for bit
            d_out = d_out.to(v.dtype)
            d_v = p.to(v.dtype).transpose(-1, -2) @ d_out  # the bf16 matmul's backward, as autograd runs it
            d_p = (d_out @ v.transpose(-1, -2)).float()
            d_s = p * (d_p - (p * d_p).sum(-1, keepdim=True)) * ctx.scaling  # softmax's backward; 0 where masked
            return d_s @ k, d_s.transpose(-1, -2) @ q, d_v, None, None, None


def register_small_attention() -> None:
    """Make SMALL_ATTENTION a transformers attention implementation, with SDPA's mask format."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(SMALL_ATTENTION, small_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(SMALL_ATTENTION, sdpa_mask)


def preallocate_cache(cache, capacity: int) -> None:
    """Turn each plain layer of a transformers DynamicCache into a `_Preallocated` one holding `capacity` positions
    (the prompt + every new token): a decoding step writes its key and value into the buffer instead of
    DynamicLayer's torch.cat, which copies the whole cache of every layer at every token (O(T^2) bytes moved over
    a response; at 512 new tokens of a 1.5B model, gigabytes per step). Sliding-window layers are left as they are.
    What the decoding loop reads is unchanged: `keys`/`values` are the first `n` positions, a view of the buffer."""
    for i, layer in enumerate(cache.layers):
        if type(layer).__name__ == "DynamicLayer" and layer.is_initialized and layer.keys.numel():
            cache.layers[i] = _Preallocated(layer.keys, layer.values, capacity)


class _Preallocated(DynamicLayer):
    """A DynamicLayer whose keys and values live in a buffer of `capacity` positions (b, h, capacity, d); `keys`
    and `values` are views of its first n. What DynamicLayer's own methods assign (a batch selection, a crop)
    becomes the new buffer, compacted: the next update grows it again, by doubling."""

    def __init__(self, keys, values, capacity: int):
        super().__init__()
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._k, self._v, self.n = self._grown(keys, capacity), self._grown(values, capacity), keys.shape[-2]

    @staticmethod
    def _grown(x, capacity):
        buf = x.new_empty((*x.shape[:-2], max(capacity, x.shape[-2]), x.shape[-1]))
        buf[..., : x.shape[-2], :] = x
        return buf

    @property
    def keys(self):
        return self._k[..., : self.n, :]

    @keys.setter
    def keys(self, x):  # (DynamicLayer's methods: a selection or a crop assigns a new tensor)
        self._k, self.n = x, x.shape[-2] if x is not None and x.dim() == 4 else 0

    @property
    def values(self):
        return self._v[..., : self.n, :]

    @values.setter
    def values(self, x):
        self._v = x

    def update(self, key_states, value_states, *args, **kwargs):
        s = key_states.shape[-2]
        if self.n + s > self._k.shape[-2]:  # past the buffer (after a compacting selection): double it
            self._k = self._grown(self.keys, 2 * (self.n + s))
            self._v = self._grown(self.values, 2 * (self.n + s))
        self._k[..., self.n : self.n + s, :] = key_states
        self._v[..., self.n : self.n + s, :] = value_states
        self.n += s
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.n

    def batch_select_indices(self, indices) -> None:  # the rows that go on, with the buffer's room kept
        self._k, self._v = self._k[indices], self._v[indices]
