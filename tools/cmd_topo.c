/*
 * cmd_topo.c - `zinf topo [--xml FILE] [--nvme-path DIR] [--gpu BUSID]`: print the NUMA
 * nodes, GPUs and storage controllers hwloc sees, then where zinf would put its host
 * memory and IO thread, and why.
 *
 * Without --gpu, the bus id of CUDA device 0 is asked from the CUDA runtime when one is
 * usable on this machine (never for an --xml topology, which describes another machine).
 * It only reports: nothing is allocated or bound.
 */
#include <ctype.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "common.h"
#include "cmd.h"
#include "tiers/cuda_probe.h"
#include "topo/topo.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: zinf topo [--xml FILE] [--nvme-path DIR] [--gpu BUSID] [--json]\n"
               "\n"
               "Show the NUMA nodes, GPUs and storage controllers of this machine (or of an\n"
               "hwloc XML topology), and the NUMA node zinf would use for its host memory\n"
               "and IO thread: the GPU's, else the node of the drive holding DIR, else the\n"
               "node of the CPU it runs on.\n"
               "\n"
               "  --xml FILE       read the topology from an hwloc XML file\n"
               "  --nvme-path DIR  the swap directory whose drive to locate\n"
               "  --gpu BUSID      the GPU's PCI bus id (DDDD:BB:DD.F); default: CUDA\n"
               "                   device 0 when CUDA is usable here\n"
               "  --json           one JSON object instead of the text\n"
               "\n"
               "Exit status: 0 success; 1 this machine's topology could not be read; 2 bad\n"
               "usage, a --gpu that is not a PCI bus id, or an --xml file that is missing or\n"
               "not an hwloc topology.\n");
}


static const char *reason_name(enum topo_reason r)
{
    switch (r) {
    case TOPO_NEAR_GPU:
        return "near the GPU";
    case TOPO_NEAR_NVME:
        return "near the swap drive";
    case TOPO_CALLER:
        return "the calling thread's node";
    default:
        return "no placement";
    }
}

/* "DDDD:BB:DD.F" or "BB:DD.F", in hexadecimal. */
static bool valid_busid(const char *s)
{
    static const char *const forms[] = {"xxxx:xx:xx.x", "xx:xx.x"};
    for (int f = 0; f < 2; f++) {
        const char *p = forms[f], *q = s;
        while (*p && *q && (*p == 'x' ? isxdigit((unsigned char)*q) : *p == *q)) {
            p++;
            q++;
        }
        if (!*p && !*q)
            return true;
    }
    return false;
}

int cmd_topo(int argc, char **argv)
{
    const char *xml = NULL, *nvme = NULL, *gpu = NULL;
    char busid[64];
    struct topo *t;
    struct topo_choice c;
    bool json = false;
    int r;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char **dst = NULL;

        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--json")) {
            json = true;
            continue;
        }
        if (!strcmp(a, "--xml"))
            dst = &xml;
        else if (!strcmp(a, "--nvme-path"))
            dst = &nvme;
        else if (!strcmp(a, "--gpu"))
            dst = &gpu;
        if (!dst) {
            fprintf(stderr, "zinf: topo: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        }
        if (i + 1 >= argc || !argv[i + 1][0]) {
            fprintf(stderr, "zinf: topo: %s needs a value\n", a);
            usage(stderr);
            return 2;
        }
        *dst = argv[++i];
    }
    if (gpu && !valid_busid(gpu)) {
        fprintf(stderr, "zinf: topo: --gpu %s: expected a PCI bus id, DDDD:BB:DD.F or BB:DD.F "
                        "in hexadecimal (nvidia-smi --query-gpu=pci.bus_id --format=csv)\n",
                gpu);
        return 2;
    }

    r = topo_open(xml, &t);
    if (r < 0) {
        char why[PATH_MAX + 512];
        topo_open_error(xml, r, why, sizeof(why));
        fprintf(stderr, "zinf: topo: %s\n", why);
        return xml ? 2 : 1;
    }
    if (!gpu && !xml && cuda_pci_busid(0, busid, sizeof(busid)) == 0) gpu = busid;

    topo_choose(t, gpu, nvme, &c);
    if (json) {
        json_t *o = topo_to_json(t);
        if (o)
            json_object_set_new(o, "placement",
                                json_pack("{s:o, s:s, s:s, s:o}", "numa_node",
                                          c.numa_node >= 0 ? json_integer(c.numa_node)
                                                           : json_null(),
                                          "reason", reason_name(c.reason), "detail", c.detail,
                                          "gpu", gpu ? json_string(gpu) : json_null()));
        topo_close(t);
        if (!o || json_dumpf(o, stdout, JSON_INDENT(2)) < 0) {
            fprintf(stderr, "zinf: topo: out of memory\n");
            json_decref(o);
            return 1;
        }
        json_decref(o);
        printf("\n");
        return 0;
    }
    topo_print(t, stdout);
    printf("placement:\n");
    if (c.numa_node >= 0)
        printf("  NUMA node %d (%s)\n", c.numa_node, reason_name(c.reason));
    else
        printf("  none (%s)\n", reason_name(c.reason));
    printf("  %s\n", c.detail);
    if (gpu == busid) printf("  (GPU: CUDA device 0, %s)\n", busid);
    topo_close(t);
    return 0;
}
