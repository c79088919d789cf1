// simt translation unit of the attention launchers: runtime dtype dispatch.
#include "kernels/attention_dispatch.cuh"
