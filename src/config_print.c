/*
 * config_print.c - config_print_settings(): every effective setting, in the table's order
 * (the ones left at their defaults marked so) and the engine options they give, one per
 * line; config_print(): those and the keys that were ignored or unknown.
 *
 * Not here: what `zinf config check` says about the run a config makes (tools/), reading
 * the file (config.c).
 */
#include <errno.h>
#include <stdio.h>

#include "common.h"
#include "config_int.h"

static const void *field_cptr(const struct zinf_config *c, const struct field *f)
{
    return (const char *)c + f->off;
}

static void print_paths(FILE *f, const struct config_paths *ps)
{
    fputc('[', f);
    for (unsigned i = 0; i < ps->count; i++) {
        if (i)
            fputs(", ", f);
        json_print_string(f, ps->path[i]);
    }
    fputc(']', f);
}

static void print_bytes(FILE *f, uint64_t bytes, const char *zero_means)
{
    char h[32];

    fprintf(f, "%llu", (unsigned long long)bytes);
    if (bytes)
        fprintf(f, "  # %s", format_size(bytes, h, sizeof(h)));
    else if (zero_means)
        fprintf(f, "  # %s", zero_means);
}

/* The name of an enum value, or "?" for one no config file could have produced. */
static const char *enum_name(const char *const *names, int v)
{
    for (int i = 0; names[i]; i++)
        if (i == v)
            return names[i];
    return "?";
}

int config_print_settings(const struct zinf_config *c, FILE *f)
{
    struct zinf_options o;

    for (size_t i = 0; i < config_nfields; i++) {
        const struct field *fd = &config_fields[i];
        const void *v = field_cptr(c, fd);
        bool dflt = !config_bit_get(c->given, fd);

        if (fd->ignored)
            continue; /* not a setting that acts: listed with the ignored keys */
        if (config_sects[fd->sect].path)
            fprintf(f, "%s.%s = ", config_sects[fd->sect].path, fd->key);
        else
            fprintf(f, "%s = ", fd->key);
        if (config_bit_get(c->autos, fd)) {
            fputs("\"auto\"  # resolved by zinf train from its model and options\n", f);
            continue;
        }
        if (dflt && (fd->flags & FL_CMD)) {
            fputs("none  # not set: the command's own default\n", f);
            continue;
        }
        switch (fd->type) {
        case F_INT:
            if ((fd->flags & FL_NULL) && !*(const int *)v)
                fputs("null", f);
            else
                fprintf(f, "%d", *(const int *)v);
            break;
        case F_UINT: fprintf(f, "%u", *(const unsigned *)v); break;
        case F_U64: fprintf(f, "%llu", (unsigned long long)*(const uint64_t *)v); break;
        case F_SIZE: fprintf(f, "%llu", (unsigned long long)*(const uint64_t *)v); break;
        case F_BOOL: fputs(*(const bool *)v ? "true" : "false", f); break;
        case F_ENUM: fprintf(f, "\"%s\"", enum_name(fd->names, *(const int *)v)); break;
        case F_PATHS: print_paths(f, v); break;
        case F_FLOAT: fprintf(f, "%.9g", *(const double *)v); break;
        case F_PAIR:
            fprintf(f, "[%.9g, %.9g]", ((const double *)v)[0], ((const double *)v)[1]);
            break;
        case F_STR:
            if ((fd->flags & FL_NULL) && !*(const char *)v)
                fputs("null", f);
            else
                json_print_string(f, v);
            break;
        }
        fputs(dflt ? "  # default\n" : "\n", f);
    }

    config_to_options(c, &o);
    fputs("# engine options\n", f);
    fputs("engine.nvme_path = ", f);
    if (o.nvme_path)
        json_print_string(f, o.nvme_path);
    else
        fputs("none  # no NVMe tier", f);
    fputs("\nengine.nvme_paths_extra = [", f);
    for (unsigned i = 0; o.nvme_paths_extra && o.nvme_paths_extra[i]; i++) {
        if (i)
            fputs(", ", f);
        json_print_string(f, o.nvme_paths_extra[i]);
    }
    fputs("]\nengine.block_size = ", f);
    print_bytes(f, o.block_size, NULL);
    fprintf(f, "\nengine.queue_depth = %u\n", o.queue_depth);
    fputs("engine.device_bytes = ", f);
    print_bytes(f, o.device_bytes,
                "engine default: on a GPU its free memory less a reserve, emulated 1 GiB");
    fputs("\nengine.host_bytes = ", f);
    print_bytes(f, o.host_bytes, "engine default: 1 GiB");
    fprintf(f, "\nengine.device_kind = %s\n", enum_name(config_device_kinds, (int)o.device_kind));
    fprintf(f, "engine.cuda_device = %d\n", o.cuda_device);
    fflush(f);
    return ferror(f) ? -EIO : 0;
}

int config_print(const struct zinf_config *c, FILE *f)
{
    config_print_settings(c, f);
    if (c->n_ignored) {
        fputs("# ignored by zinf (DeepSpeed keys zinf does not act on):\n", f);
        for (size_t i = 0; i < c->n_ignored; i++)
            fprintf(f, "#   %s\n", c->ignored[i]);
    }
    if (c->n_unknown) {
        fputs("# unknown keys (ignored):\n", f);
        for (size_t i = 0; i < c->n_unknown; i++)
            fprintf(f, "#   %s\n", c->unknown[i]);
    }
    fflush(f);
    return ferror(f) ? -EIO : 0;
}
