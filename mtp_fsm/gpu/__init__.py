"""GPU harness: the Triton checks on a CUDA machine (`python -m mtp_fsm.gpu.gpu_check`) and their step machinery."""
