/*
 * backend.c - what every backend checks when it opens (see backend.h). Not here: the
 * backends themselves (backend_cpu.c, backend_cuda.c).
 */
#include <errno.h>
#include <stdio.h>

#include "train/backend.h"

int backend_params_check(const struct backend_params *p, char *err, size_t errlen)
{
    if (gpt_config_validate(&p->cfg, err, errlen) < 0) return -EINVAL;
    if (p->B < 1 || p->T < 1 || p->T > p->cfg.maxT) {
        snprintf(err, errlen, "batch %d x seq %d does not fit the model (longest sequence %d)",
                 p->B, p->T, p->cfg.maxT);
        return -EINVAL;
    }
    if (p->wdt != BACKEND_F32 && p->wdt != BACKEND_BF16 && p->wdt != BACKEND_F16) {
        snprintf(err, errlen, "unknown weight element type %d", (int)p->wdt);
        return -EINVAL;
    }
    return 0;
}
