"""CPU models of the sm_100a MXFP8 attention kernels' schedules (`fwd_sm100`, `bwd_sm100`): see
`gem_lp.attention.cute.sm100_model`. Plain PyTorch: importing this package needs no CuTe DSL stack."""
