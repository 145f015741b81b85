"""bitsandbytes' optimizer arguments, taken by the classes that bear a bitsandbytes name
(``Lion8bit``, ``AdEMAMix8bit``, ...) so that code written for ``bitsandbytes.optim`` runs
unchanged: what we do the same way is mapped, what we do not do is refused with the reason
rather than silently ignored."""


# bitsandbytes' default min_8bit_size, and ours for min_quant_size.
DEFAULT_MIN_SIZE = 4096


def min_quant_size_from(*, min_8bit_size: int | None, min_quant_size: int | None, args, percentile_clipping,
                        block_wise, is_paged) -> int:
    """The ``min_quant_size`` that bitsandbytes' ``min_8bit_size`` means (the same threshold:
    smaller tensors keep 32-bit state; ``None`` for both: 4096), after refusing the options we
    do not implement."""
    if args is not None:
        raise ValueError(f"Invalid args: {args!r} (bitsandbytes' GlobalOptimManager arguments are not "
                         "supported; pass the options as keyword arguments)")
    if percentile_clipping != 100:
        raise ValueError(
            f"Invalid percentile_clipping: {percentile_clipping!r} (only 100, no clipping, is supported; "
            "clip with torch.nn.utils.clip_grad_norm_ before step())")
    if block_wise is not True:
        raise ValueError(f"Invalid block_wise: {block_wise!r} (the state is always quantized blockwise)")
    if is_paged is not False:
        raise ValueError(
            f"Invalid is_paged: {is_paged!r} (paged CUDA memory is not supported; "
            "lowbit_optim.CPUOffloadOptimizer keeps the state on the host instead)")
    if None not in (min_quant_size, min_8bit_size) and min_quant_size != min_8bit_size:
        raise ValueError(
            f"min_quant_size={min_quant_size!r} and min_8bit_size={min_8bit_size!r} name the same "
            "threshold: pass one of them")
    for size in (min_quant_size, min_8bit_size):
        if size is not None:
            return size
    return DEFAULT_MIN_SIZE
