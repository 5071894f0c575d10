/*
 * topo.c - the placement rule behind topo.h, on top of hwloc (the machine's tree, PCI
 * locality) and libnuma (the caller's node).
 *
 * A PCI device's node is the first NUMA node of its nearest non-I/O ancestor (a package,
 * a die, a group). A host bridge that hangs off the machine object itself carries no
 * locality on a machine with several nodes, so it answers -ENOENT there rather than a
 * guess. A path's drive is found through sysfs: st_dev -> /sys/dev/block/MAJ:MIN -> the
 * last PCI address in the resolved device path; native NVMe multipath heads (under
 * nvme-subsystem) go through their controllers, device-mapper and md volumes through
 * their first underlying device ("slaves").
 *
 * Tests point the sysfs lookups at a fake tree with ZINF_TEST_SYSFS_ROOT (read at
 * topo_open), the same way they load an XML topology instead of this machine.
 *
 * hwloc runs only the discovery components that give what is used here: the Linux one
 * (CPUs, NUMA nodes, PCI devices and their block devices, from sysfs). The others are
 * left out (BLACKLIST below): with Debian's libhwloc-plugins installed, "gl" alone opens
 * X11 displays :0 to :9, resolving names for each, on every load. This machine's
 * topology is loaded once per process, on the first topo_open(NULL), and shared
 * read-only by every handle after it (hwloc allows concurrent reads of a loaded
 * topology), so an engine open costs an allocation. An XML topology is loaded per call.
 *
 * Not here: allocation (host.c), GPU discovery (callers pass a PCI bus id), or any
 * caching of answers: every call asks the loaded topology and sysfs afresh.
 */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <hwloc.h>
#include <jansson.h>
#include <limits.h>
#include <numa.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "common.h"
#include "topo/topo.h"

#define MAX_SLAVE_DEPTH 4 /* dm on md on a partition is as deep as real stacks go */

struct topo {
    hwloc_topology_t h;
    bool shared;          /* h is this_machine, loaded once and never destroyed */
    bool thissystem;      /* false: loaded from XML, not this machine */
    bool numa_ok;         /* libnuma works here (always true for XML) */
    char source[256];     /* "this machine" or the XML file's path */
    char sysfs[PATH_MAX]; /* "/sys", or a test's fake tree */
};

/* A drive found behind a path: its PCI bus id and block device name. */
struct drive {
    int stat_err; /* stat(path) failed with this -errno; 0 when it did not */
    char busid[32];
    char name[64];
};

/* Discovery components zinf has no use for; hwloc ignores names it does not have. "pci"
 * (libpciaccess) leaks its device list and adds nothing that the Linux component's own
 * sysfs discovery does not give. "x86" binds to every CPU in turn to run cpuid for
 * vendor and model strings. The rest probe other software stacks for GPUs and
 * accelerators: X11 displays (gl), OpenCL ICDs, the CUDA runtime, NVML, ROCm SMI, oneAPI
 * Level Zero; zinf learns its GPU from CUDA by itself. */
static const char *const BLACKLIST[] = {"gl",   "opencl",    "cuda", "nvml",
                                        "rsmi", "levelzero", "pci",  "x86"};

/* A loaded hwloc topology: this machine (xml_path NULL) or an XML file. Returns 0 or
 * -errno: -EINVAL when hwloc cannot parse the XML file. */
static int load(const char *xml_path, hwloc_topology_t *out)
{
    hwloc_topology_t h;
    int ret;

    if (hwloc_topology_init(&h) != 0) return errno ? -errno : -ENOMEM;
    /* Keep every PCI device and OS device: bus id lookups must find whatever the caller
     * names, not only what hwloc calls important. */
    hwloc_topology_set_io_types_filter(h, HWLOC_TYPE_FILTER_KEEP_ALL);
#if HWLOC_API_VERSION >= 0x00020100
    for (size_t i = 0; i < ARRAY_SIZE(BLACKLIST); i++)
        hwloc_topology_set_components(h, HWLOC_TOPOLOGY_COMPONENTS_FLAG_BLACKLIST, BLACKLIST[i]);
#endif
    if (xml_path && hwloc_topology_set_xml(h, xml_path) != 0) {
        ret = -EINVAL;
        goto err;
    }
    if (hwloc_topology_load(h) != 0) {
        ret = xml_path ? -EINVAL : (errno ? -errno : -EIO);
        goto err;
    }
    *out = h;
    return 0;

err:
    hwloc_topology_destroy(h);
    return ret;
}

/* This machine's topology, loaded on first use and kept for the life of the process. */
static pthread_once_t this_machine_once = PTHREAD_ONCE_INIT;
static hwloc_topology_t this_machine;
static int this_machine_err;

static void load_this_machine(void)
{
    this_machine_err = load(NULL, &this_machine);
    if (this_machine_err)
        log_error("hwloc cannot load this machine's topology: %s", strerror(-this_machine_err));
}

/* Can hwloc read path at all: -ENOENT, -EACCES, -EISDIR before hwloc is asked to parse. */
static int check_readable(const char *path)
{
    struct stat st;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    int ret = 0;

    if (fd < 0) return -errno;
    if (fstat(fd, &st) != 0)
        ret = -errno;
    else if (S_ISDIR(st.st_mode))
        ret = -EISDIR;
    close(fd);
    return ret;
}

int topo_open(const char *xml_path, struct topo **out)
{
    struct topo *t;
    const char *root;
    int ret;

    if (!out) return -EINVAL;
    *out = NULL;
    if (xml_path && (ret = check_readable(xml_path)) != 0) return ret;
    t = calloc(1, sizeof(*t));
    if (!t) return -ENOMEM;
    if (xml_path) {
        ret = load(xml_path, &t->h);
        if (ret) {
            free(t);
            return ret;
        }
    } else {
        pthread_once(&this_machine_once, load_this_machine);
        if (this_machine_err) {
            free(t);
            return this_machine_err;
        }
        t->h = this_machine;
        t->shared = true;
    }
    t->thissystem = hwloc_topology_is_thissystem(t->h);
    t->numa_ok = !t->thissystem || numa_available() >= 0;
    snprintf(t->source, sizeof(t->source), "%s", xml_path ? xml_path : "this machine");
    root = getenv("ZINF_TEST_SYSFS_ROOT");
    snprintf(t->sysfs, sizeof(t->sysfs), "%s", root && *root ? root : "/sys");
    *out = t;
    return 0;
}

void topo_close(struct topo *t)
{
    if (!t) return;
    if (!t->shared) hwloc_topology_destroy(t->h);
    free(t);
}

/* Does hwloc parse XML with libxml2 here (Debian: libhwloc-plugins), or only with its
 * minimal built-in parser? Asked by loading a tiny topology with an XML comment, which
 * only libxml2 accepts; HWLOC_LIBXML=0 makes the answer "minimal", as it makes hwloc. */
static bool xml_has_libxml2(void)
{
    static const char probe[] =
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<!-- probe -->\n"
        "<topology version=\"2.0\"><object type=\"Machine\" os_index=\"0\" cpuset=\"0x1\" "
        "complete_cpuset=\"0x1\" allowed_cpuset=\"0x1\" nodeset=\"0x1\" complete_nodeset=\"0x1\" "
        "allowed_nodeset=\"0x1\"><object type=\"NUMANode\" os_index=\"0\" cpuset=\"0x1\" "
        "complete_cpuset=\"0x1\" nodeset=\"0x1\" complete_nodeset=\"0x1\"/><object type=\"PU\" "
        "os_index=\"0\" cpuset=\"0x1\" complete_cpuset=\"0x1\" nodeset=\"0x1\" "
        "complete_nodeset=\"0x1\"/></object></topology>\n";
    hwloc_topology_t h;
    bool ok;

    if (hwloc_topology_init(&h) != 0) return false;
    ok = hwloc_topology_set_xmlbuffer(h, probe, (int)sizeof(probe)) == 0 &&
         hwloc_topology_load(h) == 0;
    hwloc_topology_destroy(h);
    return ok;
}

void topo_open_error(const char *xml_path, int err, char *buf, size_t len)
{
    if (!buf || !len) return;
    if (!xml_path) {
        snprintf(buf, len, "cannot read this machine's topology: %s", strerror(-err));
        return;
    }
    switch (err) {
    case -ENOENT:
        snprintf(buf, len, "%s: no such file", xml_path);
        break;
    case -EACCES:
        snprintf(buf, len, "%s: cannot read it: %s", xml_path, strerror(-err));
        break;
    case -EISDIR:
        snprintf(buf, len, "%s: is a directory, not an hwloc XML file", xml_path);
        break;
    case -EINVAL:
        if (xml_has_libxml2())
            snprintf(buf, len,
                     "%s: hwloc's XML parser (libxml2) cannot read it as a topology; "
                     "HWLOC_XML_VERBOSE=1 says why",
                     xml_path);
        else
            snprintf(buf, len,
                     "%s: hwloc's minimal XML parser cannot read it as a topology: that "
                     "parser takes only XML laid out exactly as hwloc writes it (no comments, "
                     "for one). For other XML, install hwloc's libxml2 parser (Debian/Ubuntu: "
                     "libhwloc-plugins); HWLOC_XML_VERBOSE=1 says why",
                     xml_path);
        break;
    default:
        snprintf(buf, len, "%s: %s", xml_path, strerror(-err));
        break;
    }
}

int topo_numa_nodes(struct topo *t)
{
    if (!t) return -EINVAL;
    int n = hwloc_get_nbobjs_by_type(t->h, HWLOC_OBJ_NUMANODE);
    return n < 0 ? 0 : n;
}

/* "DDDD:BB:DD.F" (any domain width up to 8 hex digits, as CUDA prints 8) or "BB:DD.F".
 * Returns 0 or -EINVAL. */
static int parse_busid(const char *s, unsigned *dom, unsigned *bus, unsigned *dev, unsigned *fn)
{
    unsigned v[4];
    int n = 0, digits = 0;
    const char *p = s;

    for (;; p++) {
        char c = *p;
        if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')) {
            if (++digits > 8) return -EINVAL;
            continue;
        }
        if (digits == 0 || n == 4) return -EINVAL;
        v[n++] = (unsigned)strtoul(p - digits, NULL, 16);
        digits = 0;
        if (c == '\0') break;
        if (c != ':' && c != '.') return -EINVAL;
    }
    /* The separators must be where a bus id puts them: ':' between the fields, '.' before
     * the function. */
    const char *dot = strrchr(s, '.');
    if (!dot || strchr(dot, ':') || strchr(s, '.') != dot) return -EINVAL;
    if (n == 3) {
        *dom = 0;
        *bus = v[0], *dev = v[1], *fn = v[2];
    } else if (n == 4) {
        *dom = v[0], *bus = v[1], *dev = v[2], *fn = v[3];
    } else {
        return -EINVAL;
    }
    if (*bus > 0xff || *dev > 0x1f || *fn > 7) return -EINVAL;
    return 0;
}

/* The NUMA node local to a PCI object: -ENOENT when hwloc has no locality for it. */
static int obj_node(struct topo *t, hwloc_obj_t o)
{
    hwloc_obj_t a = hwloc_get_non_io_ancestor_obj(t->h, o);
    int node;

    if (!a || !a->nodeset || hwloc_bitmap_iszero(a->nodeset)) return -ENOENT;
    /* Attached to the machine itself: every node is as near as any other. */
    if (!a->parent && hwloc_bitmap_weight(a->nodeset) > 1) return -ENOENT;
    node = hwloc_bitmap_first(a->nodeset);
    return node < 0 ? -ENOENT : node;
}

static hwloc_obj_t find_pci(struct topo *t, const char *busid, int *err)
{
    unsigned dom, bus, dev, fn;
    hwloc_obj_t o;

    *err = parse_busid(busid, &dom, &bus, &dev, &fn);
    if (*err) return NULL;
    o = hwloc_get_pcidev_by_busid(t->h, dom, bus, dev, fn);
    if (!o) *err = -ENOENT;
    return o;
}

int topo_pci_node(struct topo *t, const char *busid)
{
    hwloc_obj_t o;
    int err;

    if (!t || !busid) return -EINVAL;
    o = find_pci(t, busid, &err);
    if (!o) return err;
    return obj_node(t, o);
}

/* Does this path component look like a PCI address, "DDDD:BB:DD.F"? */
static bool is_pci_component(const char *s, size_t n)
{
    /* domain (4+ hex) ':' bus (2) ':' device (2) '.' function (1) */
    size_t i = 0, dom = 0;

    while (i < n && isxdigit((unsigned char)s[i]))
        i++, dom++;
    if (dom < 4 || i + 8 != n) return false;
    return s[i] == ':' && isxdigit((unsigned char)s[i + 1]) && isxdigit((unsigned char)s[i + 2]) &&
           s[i + 3] == ':' && isxdigit((unsigned char)s[i + 4]) &&
           isxdigit((unsigned char)s[i + 5]) && s[i + 6] == '.' && s[i + 7] >= '0' &&
           s[i + 7] <= '7';
}

/* The last PCI address among the components of a resolved sysfs path. */
static bool last_pci_component(const char *path, char *busid, size_t len)
{
    bool found = false;
    const char *p = path;

    while (*p) {
        while (*p == '/')
            p++;
        const char *e = strchr(p, '/');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        if (n && is_pci_component(p, n) && n < len) {
            memcpy(busid, p, n);
            busid[n] = '\0';
            found = true;
        }
        p += n;
    }
    return found;
}

static bool is_file(const char *dir, const char *name)
{
    char p[PATH_MAX];
    struct stat st;

    if (snprintf(p, sizeof(p), "%s/%s", dir, name) >= (int)sizeof(p)) return false;
    return stat(p, &st) == 0;
}

/* A native NVMe multipath head lives under .../nvme-subsystem/nvme-subsysN/; its
 * controllers are the "nvmeX" entries of that directory, links to their PCI functions. */
static bool multipath_pci(const char *dev_path, char *busid, size_t len)
{
    char subsys[PATH_MAX], p[PATH_MAX], r[PATH_MAX];
    const char *m = dev_path, *end;
    struct dirent **ents;
    bool found = false;
    int n;

    /* "/nvme-subsys<N>", not its parent "/nvme-subsystem". */
    while ((m = strstr(m, "/nvme-subsys")) && !isdigit((unsigned char)m[12]))
        m++;
    if (!m) return false;
    end = strchr(m + 1, '/');
    if (!end || (size_t)(end - dev_path) >= sizeof(subsys)) return false;
    memcpy(subsys, dev_path, (size_t)(end - dev_path));
    subsys[end - dev_path] = '\0';
    n = scandir(subsys, &ents, NULL, alphasort);
    if (n < 0) return false;
    for (int i = 0; i < n; i++) {
        const char *nm = ents[i]->d_name;
        size_t k = 4;
        /* Controllers are "nvme<digits>"; "nvme<digits>n<digits>" are namespaces. */
        if (!found && !strncmp(nm, "nvme", 4) && nm[4]) {
            while (nm[k] >= '0' && nm[k] <= '9')
                k++;
            if (nm[k] == '\0' && snprintf(p, sizeof(p), "%s/%s", subsys, nm) < (int)sizeof(p) &&
                realpath(p, r) && last_pci_component(r, busid, len))
                found = true;
        }
        free(ents[i]);
    }
    free(ents);
    return found;
}

/* strlcpy: copy what fits, always terminated. */
static void copy_str(char *dst, size_t len, const char *src)
{
    size_t n = strlen(src);

    if (n >= len) n = len - 1;
    memcpy(dst, src, n);
    dst[n] = '\0';
}

/* Resolve a sysfs block device directory (real path) to the PCI function behind it. */
static int block_pci(const char *dev_path, int depth, struct drive *d)
{
    char disk[PATH_MAX], p[PATH_MAX], r[PATH_MAX];
    struct dirent **ents;
    int n, ret = -ENOENT;

    snprintf(disk, sizeof(disk), "%s", dev_path);
    /* A partition's directory sits inside its disk's. */
    if (is_file(disk, "partition")) {
        char *slash = strrchr(disk, '/');
        if (slash && slash != disk) *slash = '\0';
    }
    const char *base = strrchr(disk, '/');
    copy_str(d->name, sizeof(d->name), base ? base + 1 : disk);
    if (last_pci_component(disk, d->busid, sizeof(d->busid)) ||
        multipath_pci(disk, d->busid, sizeof(d->busid)))
        return 0;

    /* Device-mapper, md: the first underlying device that leads to PCI. */
    if (depth >= MAX_SLAVE_DEPTH || snprintf(p, sizeof(p), "%s/slaves", disk) >= (int)sizeof(p))
        return -ENOENT;
    n = scandir(p, &ents, NULL, alphasort);
    if (n < 0) return -ENOENT;
    for (int i = 0; i < n; i++) {
        if (ret != 0 && ents[i]->d_name[0] != '.' &&
            snprintf(r, sizeof(r), "%s/%s", p, ents[i]->d_name) < (int)sizeof(r)) {
            char slave[PATH_MAX];
            if (realpath(r, slave)) ret = block_pci(slave, depth + 1, d);
        }
        free(ents[i]);
    }
    free(ents);
    return ret;
}

/* The drive holding path and its node. Returns the node, or -errno (-ENOENT when the
 * path is not on a PCI block device hwloc knows about). */
static int path_drive(struct topo *t, const char *path, struct drive *d)
{
    char link[PATH_MAX], dev_path[PATH_MAX];
    struct stat st;
    int ret;

    *d = (struct drive){0};
    if (stat(path, &st) != 0) {
        d->stat_err = -errno;
        return errno == ENOENT || errno == ENOTDIR ? -ENOENT : -errno;
    }
    if (snprintf(link, sizeof(link), "%s/dev/block/%u:%u", t->sysfs, major(st.st_dev),
                 minor(st.st_dev)) >= (int)sizeof(link))
        return -ENOENT;
    /* tmpfs, overlay, NFS: anonymous device numbers have no /sys/dev/block entry. */
    if (!realpath(link, dev_path)) return -ENOENT;
    ret = block_pci(dev_path, 0, d);
    if (ret) return ret;
    return topo_pci_node(t, d->busid);
}

int topo_path_node(struct topo *t, const char *path)
{
    struct drive d;

    if (!t || !path) return -EINVAL;
    return path_drive(t, path, &d);
}

/* The NUMA node of the CPU the caller runs on, in this topology; -1 when unknown. */
static int caller_node(struct topo *t, int *cpu)
{
    hwloc_obj_t pu;
    int node;

    *cpu = sched_getcpu();
    if (*cpu < 0 || !t->numa_ok) return -1;
    if (t->thissystem) {
        pthread_mutex_lock(&numa_call_lock);
        node = numa_node_of_cpu(*cpu);
        pthread_mutex_unlock(&numa_call_lock);
        return node;
    }
    /* A topology from XML is another machine: read the CPU's node from it, so tests get
     * the answer the XML describes. */
    pu = hwloc_get_pu_obj_by_os_index(t->h, (unsigned)*cpu);
    if (!pu || !pu->nodeset) return -1;
    node = hwloc_bitmap_first(pu->nodeset);
    return node < 0 ? -1 : node;
}

static const char *why(int err)
{
    switch (err) {
    case -EINVAL:
        return "is not a PCI bus id";
    case -ENOENT:
        return "is not in the topology";
    default:
        return strerror(-err);
    }
}

/* Append to a fixed buffer, truncating quietly. */
static void add(char *buf, size_t len, size_t *pos, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void add(char *buf, size_t len, size_t *pos, const char *fmt, ...)
{
    va_list ap;
    int n;

    if (*pos >= len) return;
    va_start(ap, fmt);
    n = vsnprintf(buf + *pos, len - *pos, fmt, ap);
    va_end(ap);
    if (n > 0) *pos = MIN(len, *pos + (size_t)n);
}

void topo_choose(struct topo *t, const char *gpu_busid, const char *nvme_path,
                 struct topo_choice *out)
{
    char *det = out->detail;
    size_t len = sizeof(out->detail), pos = 0;
    struct drive d;
    int node, cpu;

    out->numa_node = -1;
    out->reason = TOPO_NONE;
    det[0] = '\0';
    if (!t) {
        add(det, len, &pos, "no topology");
        return;
    }
    if (!t->numa_ok) {
        add(det, len, &pos,
            "no NUMA support here (libnuma); memory stays where the "
            "kernel puts it");
        return;
    }

    if (gpu_busid) {
        hwloc_obj_t o;
        int err;
        o = find_pci(t, gpu_busid, &err);
        node = o ? obj_node(t, o) : err;
        if (node >= 0) {
            out->numa_node = node;
            out->reason = TOPO_NEAR_GPU;
            add(det, len, &pos, "GPU %s is local to NUMA node %d", gpu_busid, node);
            /* Say so when the drive sits on another node: the IO path crosses sockets. */
            if (nvme_path) {
                int dn = path_drive(t, nvme_path, &d);
                if (dn >= 0 && dn != node)
                    add(det, len, &pos, " (the drive %s behind %s is on node %d)", d.name,
                        nvme_path, dn);
            }
            return;
        }
        if (!o)
            add(det, len, &pos, "GPU %s %s; ", gpu_busid, why(node));
        else
            add(det, len, &pos, "GPU %s has no NUMA locality; ", gpu_busid);
    }

    if (nvme_path) {
        node = path_drive(t, nvme_path, &d);
        if (node >= 0) {
            out->numa_node = node;
            out->reason = TOPO_NEAR_NVME;
            add(det, len, &pos, "%s is on %s (PCI %s), local to NUMA node %d", nvme_path, d.name,
                d.busid, node);
            return;
        }
        if (d.stat_err)
            add(det, len, &pos, "%s: %s; ", nvme_path, strerror(-d.stat_err));
        else if (d.busid[0])
            add(det, len, &pos, "%s is on %s (PCI %s) with no NUMA locality; ", nvme_path, d.name,
                d.busid);
        else
            add(det, len, &pos, "%s is not on a PCI drive; ", nvme_path);
    }

    node = caller_node(t, &cpu);
    if (node < 0) {
        add(det, len, &pos, "the calling thread's NUMA node is unknown");
        return;
    }
    out->numa_node = node;
    out->reason = TOPO_CALLER;
    add(det, len, &pos, "the calling thread runs on CPU %d, NUMA node %d", cpu, node);
}

int topo_bind_thread(struct topo *t, int numa_node)
{
    hwloc_obj_t n;

    if (numa_node == -1) return 0;
    if (!t || numa_node < 0) return -EINVAL;
    n = hwloc_get_numanode_obj_by_os_index(t->h, (unsigned)numa_node);
    if (!n || !n->cpuset || hwloc_bitmap_iszero(n->cpuset)) return -EINVAL;
    /* Binding this thread to CPUs of a machine described in XML would be meaningless. */
    if (!t->thissystem) return -ENOTSUP;
    if (hwloc_set_cpubind(t->h, n->cpuset, HWLOC_CPUBIND_THREAD) != 0)
        return errno ? -errno : -EINVAL;
    return 0;
}

static const char *storage_kind(unsigned cls, unsigned vendor)
{
    switch (cls) {
    case 0x0100:
        return "SCSI";
    case 0x0101:
        return "IDE";
    case 0x0104:
        return "RAID";
    case 0x0106:
        return "SATA";
    case 0x0107:
        return "SAS";
    case 0x0108:
        return "NVMe";
    default:
        return vendor == 0x1af4 ? "virtio" : "storage";
    }
}

static bool is_gpu(const struct hwloc_pcidev_attr_s *p)
{
    /* Display controllers (VGA, 3D), and NVIDIA processing accelerators. */
    return (p->class_id >> 8) == 0x03 || (p->vendor_id == 0x10de && (p->class_id >> 8) == 0x12);
}

/* One PCI device line: bus id, kind, vendor:device, node, OS devices below it. */
static void print_pci(struct topo *t, FILE *f, hwloc_obj_t o, const char *kind)
{
    const struct hwloc_pcidev_attr_s *p = &o->attr->pcidev;
    const char *vname = hwloc_obj_get_info_by_name(o, "PCIVendor");
    const char *dname = hwloc_obj_get_info_by_name(o, "PCIDevice");
    int node = obj_node(t, o);
    char line[512], nodes[16];
    size_t len = sizeof(line), pos = 0;
    bool first = true;

    if (node >= 0)
        snprintf(nodes, sizeof(nodes), "%d", node);
    else
        snprintf(nodes, sizeof(nodes), "unknown");
    add(line, len, &pos, "  %04x:%02x:%02x.%x  %-7s [%04x:%04x] class %04x  node %-7s", p->domain,
        p->bus, p->dev, p->func, kind, p->vendor_id, p->device_id, p->class_id, nodes);
    for (hwloc_obj_t c = o->io_first_child; c; c = c->next_sibling) {
        if (c->type != HWLOC_OBJ_OS_DEVICE || !c->name) continue;
        add(line, len, &pos, "%s%s", first ? "  " : ",", c->name);
        first = false;
    }
    if (vname || dname)
        add(line, len, &pos, "  (%s%s%s)", vname ? vname : "", vname && dname ? " " : "",
            dname ? dname : "");
    while (pos > 0 && line[pos - 1] == ' ')
        line[--pos] = '\0';
    fprintf(f, "%s\n", line);
}

void topo_print(struct topo *t, FILE *f)
{
    hwloc_obj_t o = NULL;
    int n, count;

    if (!t || !f) return;
    n = topo_numa_nodes(t);
    fprintf(f, "topology: %s\n", t->source);
    fprintf(f, "NUMA nodes: %d%s\n", n, t->numa_ok ? "" : " (no NUMA support in libnuma)");
    for (int i = 0; i < n; i++) {
        hwloc_obj_t nd = hwloc_get_obj_by_type(t->h, HWLOC_OBJ_NUMANODE, (unsigned)i);
        char cpus[128], mem[32];
        int ncpu = nd->cpuset ? hwloc_bitmap_weight(nd->cpuset) : 0;

        if (ncpu > 0)
            hwloc_bitmap_list_snprintf(cpus, sizeof(cpus), nd->cpuset);
        else
            snprintf(cpus, sizeof(cpus), "none");
        format_size(nd->attr->numanode.local_memory, mem, sizeof(mem));
        fprintf(f, "  node %u: %d CPU%s (%s), %s\n", nd->os_index, MAX(ncpu, 0),
                ncpu == 1 ? "" : "s", cpus, mem);
    }

    count = 0;
    fprintf(f, "GPUs:\n");
    while ((o = hwloc_get_next_pcidev(t->h, o)))
        if (is_gpu(&o->attr->pcidev)) {
            print_pci(t, f, o, o->attr->pcidev.vendor_id == 0x10de ? "NVIDIA" : "GPU");
            count++;
        }
    if (!count) fprintf(f, "  none\n");

    count = 0;
    fprintf(f, "storage controllers:\n");
    while ((o = hwloc_get_next_pcidev(t->h, o)))
        if ((o->attr->pcidev.class_id >> 8) == 0x01) {
            print_pci(t, f, o, storage_kind(o->attr->pcidev.class_id, o->attr->pcidev.vendor_id));
            count++;
        }
    if (!count) fprintf(f, "  none\n");
}

static json_t *pci_json(struct topo *t, hwloc_obj_t o, const char *kind)
{
    const struct hwloc_pcidev_attr_s *p = &o->attr->pcidev;
    const char *vname = hwloc_obj_get_info_by_name(o, "PCIVendor");
    const char *dname = hwloc_obj_get_info_by_name(o, "PCIDevice");
    char busid[32];
    int node = obj_node(t, o);
    json_t *devs = json_array();

    snprintf(busid, sizeof(busid), "%04x:%02x:%02x.%x", p->domain, p->bus, p->dev, p->func);
    for (hwloc_obj_t c = o->io_first_child; c && devs; c = c->next_sibling)
        if (c->type == HWLOC_OBJ_OS_DEVICE && c->name)
            json_array_append_new(devs, json_string(c->name));
    return json_pack("{s:s, s:s, s:i, s:i, s:i, s:o, s:o, s:o, s:o}", "busid", busid, "kind",
                     kind, "vendor_id", (int)p->vendor_id, "device_id", (int)p->device_id,
                     "class_id", (int)p->class_id, "numa_node",
                     node >= 0 ? json_integer(node) : json_null(), "os_devices",
                     devs ? devs : json_array(), "vendor",
                     vname ? json_string(vname) : json_null(), "device",
                     dname ? json_string(dname) : json_null());
}

json_t *topo_to_json(struct topo *t)
{
    hwloc_obj_t o = NULL;
    if (!t)
        return NULL;
    json_t *nodes = json_array(), *gpus = json_array(), *storage = json_array();
    int n = topo_numa_nodes(t);
    for (int i = 0; i < n && nodes; i++) {
        hwloc_obj_t nd = hwloc_get_obj_by_type(t->h, HWLOC_OBJ_NUMANODE, (unsigned)i);
        char cpus[128] = "";
        int ncpu = nd->cpuset ? hwloc_bitmap_weight(nd->cpuset) : 0;
        if (ncpu > 0)
            hwloc_bitmap_list_snprintf(cpus, sizeof(cpus), nd->cpuset);
        json_array_append_new(nodes, json_pack("{s:i, s:i, s:s, s:I}", "os_index",
                                               (int)nd->os_index, "cpus", MAX(ncpu, 0),
                                               "cpuset", cpus, "memory_bytes",
                                               (json_int_t)nd->attr->numanode.local_memory));
    }
    while ((o = hwloc_get_next_pcidev(t->h, o))) {
        const struct hwloc_pcidev_attr_s *p = &o->attr->pcidev;
        if (is_gpu(p) && gpus)
            json_array_append_new(gpus, pci_json(t, o, p->vendor_id == 0x10de ? "NVIDIA" : "GPU"));
        else if ((p->class_id >> 8) == 0x01 && storage)
            json_array_append_new(storage, pci_json(t, o, storage_kind(p->class_id, p->vendor_id)));
    }
    if (!nodes || !gpus || !storage) {
        json_decref(nodes);
        json_decref(gpus);
        json_decref(storage);
        return NULL;
    }
    return json_pack("{s:s, s:b, s:o, s:o, s:o}", "topology", t->source, "numa_support",
                     t->numa_ok, "numa_nodes", nodes, "gpus", gpus, "storage", storage);
}
