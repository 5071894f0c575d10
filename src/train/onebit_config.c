/*
 * onebit_config.c - communication_data_type and 1-bit Adam's keys into the trainer's
 * options (onebit.h).
 *
 * Not here: the reductions that use the wire (trainer_shards.c).
 */
#include <errno.h>
#include <stdio.h>
#include <strings.h>

#include "comm/comm.h"
#include "train/onebit.h"

int train_config_onebit(const struct zinf_config *zc, struct trainer_opts *o, bool onebit,
                        char *err, size_t errlen)
{
    const struct config_train_keys *k = &zc->train;
    const char *dt = k->comm_dtype;
    /* DeepSpeed's values; its "fp32" is what an unset key means. */
    if (!dt[0] || strcasecmp(dt, "fp32") == 0) {
        o->comm_wire = COMM_WIRE_F32;
    } else if (strcasecmp(dt, "fp16") == 0) {
        o->comm_wire = COMM_WIRE_F16;
    } else if (strcasecmp(dt, "bf16") == 0) {
        o->comm_wire = COMM_WIRE_BF16;
    } else {
        snprintf(err, errlen,
                 "communication_data_type \"%s\": \"fp32\" (the default), \"fp16\" or \"bf16\"",
                 dt);
        return -EINVAL;
    }
    static const char *const onebit_only[] = {"optimizer.params.freeze_step",
                                              "optimizer.params.cuda_aware",
                                              "optimizer.params.comm_backend_name"};
    for (size_t q = 0; q < sizeof(onebit_only) / sizeof(onebit_only[0]) && !onebit; q++)
        if (config_given(zc, onebit_only[q])) {
            snprintf(err, errlen, "%s is OneBitAdam's: optimizer.type is \"%s\"", onebit_only[q],
                     k->optimizer.type[0] ? k->optimizer.type : "AdamW");
            return -EINVAL;
        }
    if (!onebit) return 0;
    /* DeepSpeed's OnebitAdam takes neither (its constructor refuses the keyword). */
    static const char *const not_onebit[] = {"optimizer.params.adam_w_mode",
                                             "optimizer.params.max_coeff",
                                             "optimizer.params.min_coeff"};
    for (size_t q = 0; q < sizeof(not_onebit) / sizeof(not_onebit[0]); q++)
        if (config_given(zc, not_onebit[q])) {
            snprintf(err, errlen, "%s is not OneBitAdam's", not_onebit[q]);
            return -EINVAL;
        }
    /* The backend DeepSpeed moves the compressed momentum with; zinf's own communicator
     * does it for either. */
    const char *be = k->optimizer.comm_backend_name;
    if (be[0] && strcasecmp(be, "nccl") != 0 && strcasecmp(be, "mpi") != 0) {
        snprintf(err, errlen,
                 "optimizer.params.comm_backend_name \"%s\": \"nccl\" or \"mpi\" (zinf's own "
                 "communicator moves the compressed momentum for either)",
                 be);
        return -EINVAL;
    }
    o->freeze_step = k->optimizer.freeze_step;
    return 0;
}
