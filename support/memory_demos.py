"""06's demos, each printing what README's 06 section lists: what underflows in fp16,
fp16 by hand under the loss scaler, accumulation against one batch, the bytes each
recomputation mode keeps, and the plain loss against the chunked one. They call the
lesson's own code and live here to keep 06 within its line budget; each takes the lesson
module as its first argument, since support/ imports no numbered file.
"""

import dataclasses
import functools
import math

import torch
import torch.nn as nn

from support.activations import saved_activation_bytes
from support.precision import rounding_shares


def underflow_demo(lesson, config, batches, args):
    """After fp32 training, every Linear output's |grad| (the activation gradients) and
    every parameter's, rounded to 16 bits without and with S: how many are 0?"""
    torch.manual_seed(args.seed)
    model = lesson.model_lib.GPT(config).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    fp32 = torch.float32
    for x, y in batches[:-1]:
        lesson.train_step(model, optimizer, lesson.make_scaler(fp32), None, fp32, x, y)
    outputs = []  # every Linear's output: their gradients are the activation gradients
    for linear in (m for m in model.modules() if isinstance(m, nn.Linear)):
        linear.register_forward_hook(lambda module, inputs, out: outputs.append(out))
    _, loss = model(*batches[-1])
    g = torch.autograd.grad(loss, outputs + list(model.parameters()))
    n = len(outputs)
    S = args.init_scale
    cases = (("fp16", 1.0), (f"fp16 x 2^{math.log2(S):.0f}", S), ("bf16", 1.0))
    print(f"gradients after {len(batches) - 1} fp32 steps, rounded  0  subnormal  inf")
    grads = {}  # The non-zeros, returned so that a caller can plot them.
    for name, ts in (("activation grads", g[:n]), ("parameter grads", g[n:])):
        flat = torch.cat([t.abs().flatten() for t in ts]).cpu()
        flat = grads[name] = flat[flat > 0]
        for label, s in cases:
            zero, sub, inf = rounding_shares(flat, lesson.DTYPES[label[:4]], s)
            print(f"{name:<17} to {label:<12} {zero:>7.2%} {sub:>10.2%} {inf:>4.0%}")
        print(f"({name}: median |g| {flat.median():.1e})")
    return grads


def fp16_training_demo(lesson, config, batches, args):
    """fp16 by hand under the scaler, started too high on purpose, beside fp32."""
    print("\nfp16 by hand: MasterWeights + DynamicLossScaler(2^19, growth_interval=3)")
    print("step  loss fp32  loss fp16  scale after  skipped")
    runs = []
    for dtype in (torch.float32, torch.float16):
        torch.manual_seed(args.seed)
        model = lesson.model_lib.GPT(config).to(args.device)
        master = lesson.MasterWeights(model, dtype) if dtype != torch.float32 else None
        optimizer = torch.optim.AdamW((master or model).parameters(), lr=args.lr)
        scaler = lesson.make_scaler(dtype, init_scale=2.0**19, growth_interval=3)
        runs.append([])
        for x, y in batches[: args.fp16_steps]:
            loss = lesson.train_step(
                model, optimizer, scaler, master, torch.float32, x, y
            )
            runs[-1].append((loss, scaler.get_scale(), scaler.last_step_skipped))
    for step, (fp32, fp16) in enumerate(zip(*runs)):
        scale = f"2^{math.log2(fp16[1]):.0f}"
        print(f"{step:>4} {fp32[0]:>10.4f} {fp16[0]:>10.4f} {scale:>12} {fp16[2]!s:>8}")
    print("(a skipped step changes no weight: fp16 has had that many fewer updates)\n")


def accumulation_demo(lesson, config, args):
    """k microbatches against one batch, then with T/(i+1) targets in microbatch i."""
    k = args.accum
    b = args.batch_size // k
    T = config.block_size
    torch.manual_seed(args.seed)
    model = lesson.model_lib.GPT(config).to(args.device)
    [(x, y)] = lesson.model_lib.byte_batches(T, k * b, 1, args.seed + 1, args.device)
    padded = y.clone()  # (k·b, T)
    for i in range(k):
        padded[i * b : (i + 1) * b, T // (i + 1) :] = lesson.IGNORE

    def grads(fn) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        fn()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    print(f"{k} microbatches of {b} rows vs one batch of {k * b}, max |g - g_batch|")
    print("/ max |g_batch|:      token-normalised  mean of means  tokens each")
    for label, targets in (("equal tokens", y), ("unequal tokens", padded)):
        micro = list(zip(x.split(b), targets.split(b)))
        one_batch = grads(lambda t=targets: model(x, t)[1].backward())
        n = lesson.global_token_count(micro)
        normalised = grads(
            lambda m=micro, n=n: lesson.accumulate_gradients(model, m, n)
        )
        mean_of_means = grads(lambda m=micro: lesson.accumulate_mean_of_means(model, m))
        top = one_batch.abs().max()
        ours = (normalised - one_batch).abs().max() / top
        trap = (mean_of_means - one_batch).abs().max() / top
        counts = [int(lesson.count_tokens(t)) for _, t in micro]
        print(f"{label:<20} {ours:>17.1e} {trap:>14.1e}  {counts}")


def recompute_demo(lesson, config, args):
    """Each mode's bytes held for the backward, in all and a layer (L layers' less
    L - 1's), beside the formula; with dropout 0.1, the gradients against none's."""
    T = config.block_size
    [(x, y)] = lesson.model_lib.byte_batches(
        T, args.batch_size, 1, args.seed, args.device
    )
    B = args.batch_size
    L = config.n_layer
    tokens = f"{B * T} tokens, {L} blocks"
    print(f"\napply_recomputation, fp32, {tokens}: bytes held for the backward")
    print("mode        held KB  formula  a layer, bytes/token: held formula same grads")
    reference = None
    for mode in lesson.RECOMPUTE:
        held = {}
        for layers, dropout in ((L - 1, 0.0), (L, 0.0), (L, 0.1)):  # last: with masks
            torch.manual_seed(args.seed)
            changed = dataclasses.replace(config, dropout=dropout, n_layer=layers)
            model = lesson.apply_recomputation(
                lesson.model_lib.GPT(changed).to(args.device), mode
            )
            forward = functools.partial(model, x, y)
            (_, loss), held[layers, dropout] = saved_activation_bytes(forward)
        loss.backward()  # the last model's: dropout 0.1
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        reference = grads if reference is None else reference
        same = torch.equal(grads, reference)
        sizes = [dataclasses.replace(config, n_layer=n) for n in (L - 1, L)]
        formula = [lesson.activation_formula(c, B, T, "fp32", mode) for c in sizes]
        layer = (held[L, 0.0] - held[L - 1, 0.0]) / (B * T)
        layer_formula = (formula[1] - formula[0]) / (B * T)
        kb = f"{held[L, 0.0] / 1024:>8.1f} {formula[1] / 1024:>8.1f}"
        print(f"{mode:<11} {kb} {layer:>26,.0f} {layer_formula:>7,.0f} {same!s:>10}")
    print(f"(fp32, r = a = 4: 64C + 16 + 4nh, 44C + 4nh, 4C; C = {config.n_embd})")


def chunked_loss_demo(lesson, config, args):
    """The plain loss, then the chunked one, on one batch of a GPT with V >> C as
    GPT-2's (V = 4,000 here): bytes held for the backward (counted, and the formula),
    the loss's part of them, the (B, T, V) logits and dL/dlogits that live besides
    (all in KB), and the loss and the gradients against the plain ones."""
    config = dataclasses.replace(config, vocab_size=4000, pad_vocab_multiple=64)
    T = config.block_size
    B = args.batch_size
    V = config.padded_vocab_size
    [(x, y)] = lesson.model_lib.byte_batches(T, B, 1, args.seed, args.device)
    y[0, : T // 2] = lesson.IGNORE  # a masked prompt: its targets do not count
    tokens = f"{B * T} tokens, V = {V:,} ({config.vocab_size:,} real)"
    print(f"\nthe loss, fp32, {tokens}, chunks of {args.chunk_tokens} tokens")
    print("loss      held KB  formula the loss  +logits     loss  max|g - g_plain|")
    grads = []
    for loss in ("plain", "chunked"):
        torch.manual_seed(args.seed)
        model = lesson.model_lib.GPT(config).to(args.device)
        if loss == "chunked":
            lesson.apply_chunked_loss(model, args.chunk_tokens)
        (_, value), held = saved_activation_bytes(functools.partial(model, x, y))
        value.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        formula = lesson.activation_formula(config, B, T, "fp32", loss=loss)
        share = lesson.loss_formula(config, B, T, "fp32", loss)
        logits = 2 * B * T * V * 4 if loss == "plain" else 0  # logits, dL/dlogits
        kb = "".join(f"{n / 1024:>9.1f}" for n in (held, formula, share, logits))
        off = (grads[-1] - grads[0]).abs().max() / grads[0].abs().max()
        print(f"{loss:<8}{kb} {value.item():>8.4f} {off:>17.1e}")
    print("(+logits: the (B, T, V) logits and dL/dlogits the plain loss holds besides;")
    print(" max|g - g_plain| over every parameter's gradient, / max|g_plain|)")
