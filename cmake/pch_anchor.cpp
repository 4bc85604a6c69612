// Anchor source of the qkv_pch object library: it exists so that CMake has a target that
// compiles the shared precompiled header (<torch/torch.h>) once for the whole project.
