/*
 * config_auto.c - "auto", as Hugging Face's Trainer writes it into a DeepSpeed config:
 * config_resolve_auto() fills each setting the file left "auto" from what only its caller
 * knows (the model's width, the run's batch, lr and steps), by the formulas of transformers'
 * DeepSpeed integration, and says what each became.
 *
 * Not here: which settings may be "auto" (FL_AUTO in config_keys.c's table) or reading the
 * file (config.c).
 */
#include <math.h>
#include <stdio.h>

#include "config_int.h"

/* Set an "auto" field to v and say so: "path = v" on a line of its own. */
static void resolve(struct zinf_config *c, const char *json_path, double v, char *out,
                    size_t outlen, size_t *len)
{
    const struct field *f = config_field_by_path(json_path);
    if (!f || !config_bit_get(c->autos, f))
        return;
    void *dst = (char *)c + f->off;
    switch (f->type) {
    case F_INT: *(int *)dst = (int)v; break;
    case F_U64: *(uint64_t *)dst = (uint64_t)v; break;
    case F_BOOL: *(bool *)dst = v != 0; break;
    case F_FLOAT: *(double *)dst = v; break;
    default: return; /* F_PAIR is set by the caller */
    }
    c->autos[config_field_index(f) / 64] &= ~(1ull << (config_field_index(f) % 64));
    if (*len < outlen) {
        if (f->type == F_BOOL)
            *len += (size_t)snprintf(out + *len, outlen - *len, "%s%s = %s", *len ? "\n" : "",
                                     json_path, v != 0 ? "true" : "false");
        else
            *len += (size_t)snprintf(out + *len, outlen - *len, "%s%s = %.7g", *len ? "\n" : "",
                                     json_path, v);
    }
}

void config_resolve_auto(struct zinf_config *c, const struct config_auto_inputs *in, char *out,
                         size_t outlen)
{
    size_t len = 0;
    double d = in->hidden_size;
    if (outlen)
        out[0] = '\0';
    /* As transformers' integrations/deepspeed.py fills them in. */
    resolve(c, "train_micro_batch_size_per_gpu", in->micro_batch, out, outlen, &len);
    resolve(c, "gradient_accumulation_steps", in->grad_accum, out, outlen, &len);
    resolve(c, "train_batch_size", (double)in->micro_batch * in->grad_accum, out, outlen, &len);
    resolve(c, "gradient_clipping", in->grad_clip, out, outlen, &len);
    resolve(c, "optimizer.params.lr", in->lr, out, outlen, &len);
    resolve(c, "optimizer.params.eps", 1e-8, out, outlen, &len);
    resolve(c, "optimizer.params.weight_decay", in->weight_decay, out, outlen, &len);
    const struct field *b = config_field_by_path("optimizer.params.betas");
    if (config_bit_get(c->autos, b)) {
        c->train.optimizer.betas[0] = 0.9;
        c->train.optimizer.betas[1] = 0.999;
        c->autos[config_field_index(b) / 64] &= ~(1ull << (config_field_index(b) % 64));
        if (len < outlen)
            len += (size_t)snprintf(out + len, outlen - len, "%soptimizer.params.betas = [0.9, "
                                    "0.999]", len ? "\n" : "");
    }
    resolve(c, "scheduler.params.warmup_min_lr", 0, out, outlen, &len);
    resolve(c, "scheduler.params.warmup_max_lr", in->lr, out, outlen, &len);
    resolve(c, "scheduler.params.warmup_num_steps", 0, out, outlen, &len);
    resolve(c, "scheduler.params.total_num_steps", in->steps, out, outlen, &len);
    resolve(c, "fp16.enabled", in->fp16 > 0, out, outlen, &len);
    if (in->bf16 >= 0)
        resolve(c, "bf16.enabled", in->bf16, out, outlen, &len);
    /* transformers' formulas, from the model's hidden size. */
    resolve(c, "zero_optimization.stage3_prefetch_bucket_size", floor(0.9 * d * d), out, outlen,
            &len);
    resolve(c, "zero_optimization.stage3_param_persistence_threshold", 10 * d, out, outlen, &len);
    resolve(c, "zero_optimization.reduce_bucket_size", d * d, out, outlen, &len);
}
