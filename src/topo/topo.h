/*
 * topo.h - where zinf puts its memory and IO thread: the NUMA node nearest the GPU
 * (hwloc: the GPU's PCI locality), else nearest the NVMe drive behind the swap path,
 * else the caller's node. Decisions are testable without the hardware: a topology can be
 * loaded from hwloc XML.
 *
 * Not here: allocation (host.c uses the answer with libnuma) or GPU discovery (the PCI
 * bus id is passed in).
 */
#ifndef ZINF_TOPO_TOPO_H
#define ZINF_TOPO_TOPO_H

#include <stdio.h>

struct topo;

enum topo_reason { TOPO_NONE, TOPO_NEAR_GPU, TOPO_NEAR_NVME, TOPO_CALLER };

struct topo_choice {
    int numa_node;               /* -1 when the machine has no NUMA information */
    enum topo_reason reason;
    char detail[256];            /* e.g. "GPU 0000:17:00.0 is local to NUMA node 1" */
};

/* xml_path: an hwloc XML file to load instead of this machine (tests), or NULL: this
 * machine, whose topology is loaded once per process and shared by every handle.
 * Returns 0, or for an XML file -ENOENT, -EACCES, -EISDIR, -EINVAL (hwloc cannot parse it)
 * and nothing is logged: topo_open_error() says why. */
int topo_open(const char *xml_path, struct topo **out);
void topo_close(struct topo *t);
/* The reason topo_open(xml_path) failed with err, as one line for people: for a file
 * hwloc cannot parse, which of hwloc's XML parsers refused it and what would help. */
void topo_open_error(const char *xml_path, int err, char *buf, size_t len);
int topo_numa_nodes(struct topo *t);
/* NUMA node local to a PCI device "DDDD:BB:DD.F" (or "BB:DD.F"); -ENOENT if unknown. */
int topo_pci_node(struct topo *t, const char *busid);
/* NUMA node local to the block device holding path (sysfs -> PCI -> hwloc); -ENOENT. */
int topo_path_node(struct topo *t, const char *path);
/* The placement rule above. gpu_busid and nvme_path may be NULL. */
void topo_choose(struct topo *t, const char *gpu_busid, const char *nvme_path,
                 struct topo_choice *out);
/* Bind the calling thread's CPUs to a NUMA node (no-op for -1). */
int topo_bind_thread(struct topo *t, int numa_node);
/* Human-readable summary: nodes, GPUs and NVMe/storage PCI devices with their nodes. */
void topo_print(struct topo *t, FILE *f);
/* The same as a jansson object (the caller owns it): "topology", "numa_nodes" [{"os_index",
 * "cpus", "cpuset", "memory_bytes"}], "gpus" and "storage" [{"busid", "kind", "vendor_id",
 * "device_id", "class_id", "numa_node" (null when unknown), "os_devices", "vendor",
 * "device"}]. NULL when out of memory. */
struct json_t;
struct json_t *topo_to_json(struct topo *t);

#endif
