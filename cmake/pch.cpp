// Compiles the precompiled header once; every LibTorch target reuses it.
