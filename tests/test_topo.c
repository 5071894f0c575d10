/*
 * test_topo.c - topo.h: PCI locality and the placement rule on a synthetic two-node
 * machine (tests/data/two_nodes.xml, read with each of hwloc's XML parsers), the errors
 * for XML files hwloc cannot read, the sysfs walk from a path to its drive on fake sysfs
 * trees (ZINF_TEST_SYSFS_ROOT), and the same calls on this machine, where only sanity can
 * be asserted, and which is loaded once per process with hwloc's Linux component alone.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <numa.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#include "common.h"
#include "helpers.h"
#include "topo/topo.h"

/* In two_nodes.xml. */
#define GPU "0000:98:00.0"  /* NVIDIA, class 0302, package 1 -> node 1 */
#define NVME "0000:3b:00.0" /* class 0108, package 0 -> node 0 */
#define NIC "0000:99:00.0"  /* package 1 -> node 1 */
#define SATA "0000:00:1f.2" /* host bridge on the machine: no locality */
#define ABSENT "0000:5e:00.0"

#define NVME_DEV "devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/nvme/nvme0"

static struct topo *open_xml(void)
{
    const char *dir = getenv("ZINF_TEST_DATA");
    char path[PATH_MAX];
    struct topo *t = NULL;

    cr_assert(dir, "ZINF_TEST_DATA is not set");
    snprintf(path, sizeof(path), "%s/two_nodes.xml", dir);
    int r = topo_open(path, &t);
    cr_assert_eq(r, 0, "topo_open(%s): %s", path, strerror(-r));
    return t;
}

/* Run on CPU 0 so that "the caller's node" is known in the XML (PU 0 is on node 0). */
static void run_on_cpu0(void)
{
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(0, &s);
    cr_assert_eq(sched_setaffinity(0, sizeof(s), &s), 0);
}

static void mkdirs(const char *path)
{
    char p[PATH_MAX];
    snprintf(p, sizeof(p), "%s", path);
    for (char *s = p + 1; *s; s++)
        if (*s == '/') {
            *s = '\0';
            mkdir(p, 0755);
            *s = '/';
        }
    mkdir(p, 0755);
}

static void touch(const char *root, const char *rel)
{
    char p[PATH_MAX];
    snprintf(p, sizeof(p), "%s/%s", root, rel);
    FILE *f = fopen(p, "w");
    cr_assert(f, "%s", p);
    fclose(f);
}

static void dir_at(const char *root, const char *rel)
{
    char p[PATH_MAX];
    snprintf(p, sizeof(p), "%s/%s", root, rel);
    mkdirs(p);
}

static void link_at(const char *root, const char *rel, const char *target)
{
    char p[PATH_MAX];
    snprintf(p, sizeof(p), "%s/%s", root, rel);
    unlink(p);
    cr_assert_eq(symlink(target, p), 0, "symlink %s: %s", p, strerror(errno));
}

/* Make the fake sysfs say that the device holding path is at devices/<rel>. */
static void fake_block(const char *root, const char *path, const char *rel)
{
    struct stat st;
    char name[64], target[PATH_MAX];

    cr_assert_eq(stat(path, &st), 0);
    dir_at(root, "dev/block");
    dir_at(root, rel);
    snprintf(name, sizeof(name), "dev/block/%u:%u", major(st.st_dev), minor(st.st_dev));
    snprintf(target, sizeof(target), "../../%s", rel);
    link_at(root, name, target);
}

/* A fake sysfs root for this test; ZINF_TEST_SYSFS_ROOT must be set before topo_open. */
static char *fake_sysfs(void)
{
    char *root = test_tmpdir("sysfs");
    cr_assert(root);
    cr_assert_eq(setenv("ZINF_TEST_SYSFS_ROOT", root, 1), 0);
    return root;
}

TestSuite(topo, .fini = test_leak_check);

Test(topo, xml_counts_nodes)
{
    struct topo *t = open_xml();
    cr_assert_eq(topo_numa_nodes(t), 2);
    topo_close(t);
}

Test(topo, pci_node_from_xml)
{
    struct topo *t = open_xml();

    cr_assert_eq(topo_pci_node(t, GPU), 1);
    cr_assert_eq(topo_pci_node(t, NVME), 0);
    cr_assert_eq(topo_pci_node(t, NIC), 1);
    /* The forms people paste: no domain, CUDA's 8-digit domain, upper case. */
    cr_assert_eq(topo_pci_node(t, "98:00.0"), 1);
    cr_assert_eq(topo_pci_node(t, "00000000:98:00.0"), 1);
    cr_assert_eq(topo_pci_node(t, "0000:3B:00.0"), 0);
    topo_close(t);
}

Test(topo, pci_node_unknown_or_without_locality)
{
    struct topo *t = open_xml();

    cr_assert_eq(topo_pci_node(t, ABSENT), -ENOENT);
    cr_assert_eq(topo_pci_node(t, "0001:98:00.0"), -ENOENT, "another PCI domain");
    /* A host bridge on the machine object: every node is as near, so no answer. */
    cr_assert_eq(topo_pci_node(t, SATA), -ENOENT);
    topo_close(t);
}

Test(topo, pci_node_bad_input)
{
    struct topo *t = open_xml();
    static const char *const bad[] = {
        "",
        "zz",
        "0000:98:00",
        "0000:98:00.8",
        "0000:98.00.0",
        "1:2:3:4.0",
        "0000:98:00.0 ",
        "0000::00.0",
        ":98:00.0",
        "0000:98:20.0",
        "0000:198:00.0",
        "000000000:98:00.0",
        "0000:98:00.0.1",
        "98-00.0",
    };

    for (size_t i = 0; i < ARRAY_SIZE(bad); i++)
        cr_assert_eq(topo_pci_node(t, bad[i]), -EINVAL, "'%s'", bad[i]);
    cr_assert_eq(topo_pci_node(t, NULL), -EINVAL);
    cr_assert_eq(topo_pci_node(NULL, GPU), -EINVAL);
    topo_close(t);
}

Test(topo, choose_near_gpu)
{
    struct topo *t = open_xml();
    struct topo_choice c;

    topo_choose(t, GPU, NULL, &c);
    cr_assert_eq(c.numa_node, 1);
    cr_assert_eq(c.reason, TOPO_NEAR_GPU);
    cr_assert(strstr(c.detail, GPU) && strstr(c.detail, "NUMA node 1"), "%s", c.detail);
    topo_close(t);
}

Test(topo, choose_unknown_gpu_falls_back_to_caller)
{
    struct topo *t = open_xml();
    struct topo_choice c;

    run_on_cpu0();
    topo_choose(t, ABSENT, NULL, &c);
    cr_assert_eq(c.reason, TOPO_CALLER);
    cr_assert_eq(c.numa_node, 0);
    cr_assert(strstr(c.detail, ABSENT) && strstr(c.detail, "not in the topology") &&
                  strstr(c.detail, "CPU 0"),
              "%s", c.detail);

    /* A device without locality and a malformed id fall back the same way. */
    topo_choose(t, SATA, NULL, &c);
    cr_assert_eq(c.reason, TOPO_CALLER);
    cr_assert(strstr(c.detail, "no NUMA locality"), "%s", c.detail);
    topo_choose(t, "not-a-bus-id", NULL, &c);
    cr_assert_eq(c.reason, TOPO_CALLER);
    cr_assert(strstr(c.detail, "is not a PCI bus id"), "%s", c.detail);
    topo_close(t);
}

Test(topo, choose_without_anything_is_the_caller)
{
    struct topo *t = open_xml();
    struct topo_choice c;

    run_on_cpu0();
    topo_choose(t, NULL, NULL, &c);
    cr_assert_eq(c.reason, TOPO_CALLER);
    cr_assert_eq(c.numa_node, 0);
    topo_close(t);
}

Test(topo, choose_null_topology)
{
    struct topo_choice c;

    topo_choose(NULL, GPU, "/", &c);
    cr_assert_eq(c.numa_node, -1);
    cr_assert_eq(c.reason, TOPO_NONE);
    cr_assert_eq(topo_numa_nodes(NULL), -EINVAL);
    cr_assert_eq(topo_path_node(NULL, "/"), -EINVAL);
    cr_assert_eq(topo_bind_thread(NULL, 0), -EINVAL);
    topo_print(NULL, stdout);
    topo_close(NULL);
}

Test(topo, path_node_nvme_disk)
{
    char *root = fake_sysfs(), *dir = test_tmpdir("nvme");
    struct topo *t;
    struct topo_choice c;

    fake_block(root, dir, NVME_DEV "/nvme0n1");
    t = open_xml();
    cr_assert_eq(topo_path_node(t, dir), 0);

    run_on_cpu0();
    topo_choose(t, NULL, dir, &c);
    cr_assert_eq(c.reason, TOPO_NEAR_NVME);
    cr_assert_eq(c.numa_node, 0);
    cr_assert(strstr(c.detail, "nvme0n1") && strstr(c.detail, NVME), "%s", c.detail);

    /* The GPU wins, and the detail says that the drive is on the other node. */
    topo_choose(t, GPU, dir, &c);
    cr_assert_eq(c.reason, TOPO_NEAR_GPU);
    cr_assert_eq(c.numa_node, 1);
    cr_assert(strstr(c.detail, "nvme0n1") && strstr(c.detail, "node 0"), "%s", c.detail);

    /* An unknown GPU falls back to the drive. */
    topo_choose(t, ABSENT, dir, &c);
    cr_assert_eq(c.reason, TOPO_NEAR_NVME);
    cr_assert_eq(c.numa_node, 0);
    cr_assert(strstr(c.detail, ABSENT), "%s", c.detail);
    topo_close(t);
    test_rmtree(dir);
    test_rmtree(root);
}

Test(topo, path_node_partition)
{
    char *root = fake_sysfs(), *dir = test_tmpdir("part");
    struct topo *t;
    struct topo_choice c;

    fake_block(root, dir, NVME_DEV "/nvme0n1/nvme0n1p2");
    touch(root, NVME_DEV "/nvme0n1/nvme0n1p2/partition");
    t = open_xml();
    cr_assert_eq(topo_path_node(t, dir), 0);
    topo_choose(t, NULL, dir, &c);
    cr_assert(strstr(c.detail, "on nvme0n1 "), "the disk, not the partition: %s", c.detail);
    topo_close(t);
    test_rmtree(dir);
    test_rmtree(root);
}

Test(topo, path_node_nvme_multipath)
{
    char *root = fake_sysfs(), *dir = test_tmpdir("mpath");
    const char *subsys = "devices/virtual/nvme-subsystem/nvme-subsys0";
    char rel[PATH_MAX];
    struct topo *t;

    /* The head disk lives under the subsystem; its controllers link to PCI. */
    snprintf(rel, sizeof(rel), "%s/nvme0n1", subsys);
    fake_block(root, dir, rel);
    dir_at(root, NVME_DEV);
    snprintf(rel, sizeof(rel), "%s/nvme0", subsys);
    link_at(root, rel, "../../../pci0000:3a/0000:3a:00.0/0000:3b:00.0/nvme/nvme0");
    t = open_xml();
    cr_assert_eq(topo_path_node(t, dir), 0);
    topo_close(t);
    test_rmtree(dir);
    test_rmtree(root);
}

Test(topo, path_node_device_mapper)
{
    char *root = fake_sysfs(), *dir = test_tmpdir("dm");
    struct topo *t;

    /* dm-0 (LVM, dm-crypt) over a partition of the NVMe drive. */
    fake_block(root, dir, "devices/virtual/block/dm-0");
    dir_at(root, "devices/virtual/block/dm-0/slaves");
    dir_at(root, NVME_DEV "/nvme0n1/nvme0n1p1");
    touch(root, NVME_DEV "/nvme0n1/nvme0n1p1/partition");
    link_at(root, "devices/virtual/block/dm-0/slaves/nvme0n1p1",
            "../../../../pci0000:3a/0000:3a:00.0/0000:3b:00.0/nvme/nvme0/nvme0n1/nvme0n1p1");
    t = open_xml();
    cr_assert_eq(topo_path_node(t, dir), 0);
    topo_close(t);
    test_rmtree(dir);
    test_rmtree(root);
}

Test(topo, path_node_not_on_pci)
{
    char *root = fake_sysfs(), *dir = test_tmpdir("virt");
    struct topo *t;
    struct topo_choice c;

    t = open_xml();
    /* No /sys/dev/block entry at all (tmpfs, overlay). */
    cr_assert_eq(topo_path_node(t, dir), -ENOENT);
    /* A virtual block device (loop, zram) without slaves. */
    fake_block(root, dir, "devices/virtual/block/loop0");
    cr_assert_eq(topo_path_node(t, dir), -ENOENT);
    /* A device-mapper volume whose slaves lead nowhere. */
    fake_block(root, dir, "devices/virtual/block/dm-1");
    dir_at(root, "devices/virtual/block/dm-1/slaves");
    cr_assert_eq(topo_path_node(t, dir), -ENOENT);
    /* A PCI drive the topology does not know. */
    fake_block(root, dir, "devices/pci0000:5d/0000:5d:00.0/0000:5e:00.0/nvme/nvme1/nvme1n1");
    cr_assert_eq(topo_path_node(t, dir), -ENOENT);
    run_on_cpu0();
    topo_choose(t, NULL, dir, &c);
    cr_assert_eq(c.reason, TOPO_CALLER);
    cr_assert(strstr(c.detail, "nvme1n1") && strstr(c.detail, "0000:5e:00.0"), "%s", c.detail);
    /* A drive whose controller has no locality. */
    fake_block(root, dir,
               "devices/pci0000:00/0000:00:1f.2/ata1/host0/target0:0:0/0:0:0:0/block/sda");
    cr_assert_eq(topo_path_node(t, dir), -ENOENT);
    cr_assert_eq(topo_path_node(t, "/no/such/path"), -ENOENT);
    topo_choose(t, NULL, "/no/such/path", &c);
    cr_assert_eq(c.reason, TOPO_CALLER);
    cr_assert(strstr(c.detail, "/no/such/path: No such file"), "%s", c.detail);
    cr_assert_eq(topo_path_node(t, NULL), -EINVAL);
    topo_close(t);
    test_rmtree(dir);
    test_rmtree(root);
}

Test(topo, sata_behind_scsi_host_path)
{
    char *root = fake_sysfs(), *dir = test_tmpdir("sata");
    struct topo *t;

    /* SCSI's "0:0:0:0" and "target0:0:0" components are not PCI addresses; the
     * controller's address before them is. NVME stands in for a SAS HBA on node 0. */
    fake_block(root, dir,
               "devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/host2/target2:0:0/2:0:0:0/block/sdb");
    t = open_xml();
    cr_assert_eq(topo_path_node(t, dir), 0);
    topo_close(t);
    test_rmtree(dir);
    test_rmtree(root);
}

Test(topo, print_xml)
{
    struct topo *t = open_xml();
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);

    topo_print(t, f);
    fclose(f);
    cr_assert(strstr(buf, "NUMA nodes: 2"), "%s", buf);
    cr_assert(strstr(buf, "node 0: 4 CPUs (0-3), 16 GiB"), "%s", buf);
    cr_assert(strstr(buf, "node 1: 4 CPUs (4-7), 16 GiB"), "%s", buf);
    cr_assert(strstr(buf, GPU "  NVIDIA"), "%s", buf);
    cr_assert(strstr(buf, NVME "  NVMe"), "%s", buf);
    cr_assert(strstr(buf, "nvme0n1"), "%s", buf);
    cr_assert(strstr(buf, SATA "  SATA"), "%s", buf);
    cr_assert(strstr(buf, "node unknown"), "%s", buf);
    cr_assert(!strstr(buf, NIC), "a NIC is neither a GPU nor storage: %s", buf);
    free(buf);
    topo_close(t);
}

Test(topo, bind_on_xml_is_refused)
{
    struct topo *t = open_xml();

    cr_assert_eq(topo_bind_thread(t, 1), -ENOTSUP);
    cr_assert_eq(topo_bind_thread(t, -1), 0);
    cr_assert_eq(topo_bind_thread(t, 2), -EINVAL);
    topo_close(t);
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    cr_assert(f, "%s: %s", path, strerror(errno));
    fputs(text, f);
    fclose(f);
}

/* two_nodes.xml's text with an XML comment after its header lines, into dir/name. */
static void write_commented_copy(const char *dir, const char *name, char *path, size_t len)
{
    char src[PATH_MAX], line[4096];
    FILE *in, *out;
    int n = 0;

    snprintf(src, sizeof(src), "%s/two_nodes.xml", getenv("ZINF_TEST_DATA"));
    snprintf(path, len, "%s/%s", dir, name);
    in = fopen(src, "r");
    out = fopen(path, "w");
    cr_assert(in && out);
    while (fgets(line, sizeof(line), in)) {
        if (n++ == 2) fputs("<!-- a comment, as people write them -->\n", out);
        fputs(line, out);
    }
    fclose(in);
    fclose(out);
}

static const char *open_error(const char *path, int err)
{
    static char why[PATH_MAX + 512];
    topo_open_error(path, err, why, sizeof(why));
    return why;
}

Test(topo, open_bad_xml_says_what_is_wrong)
{
    struct topo *t = (struct topo *)1;
    char *dir = test_tmpdir("badxml");
    char path[PATH_MAX];
    const char *why;

    cr_assert_eq(topo_open("/no/such/file.xml", &t), -ENOENT);
    cr_assert_null(t);
    cr_assert(strstr(open_error("/no/such/file.xml", -ENOENT), "/no/such/file.xml: no such file"));

    cr_assert_eq(topo_open(dir, &t), -EISDIR);
    cr_assert(strstr(open_error(dir, -EISDIR), "is a directory"), "%s", open_error(dir, -EISDIR));

    /* Unreadable: only where permissions apply (root reads anything). */
    snprintf(path, sizeof(path), "%s/secret.xml", dir);
    write_text(path, "<?xml version=\"1.0\"?>\n");
    cr_assert_eq(chmod(path, 0), 0);
    if (geteuid() != 0) {
        cr_assert_eq(topo_open(path, &t), -EACCES);
        cr_assert(strstr(open_error(path, -EACCES), "cannot read it"), "%s",
                  open_error(path, -EACCES));
    }

    /* Well-formed XML that is no topology: refused by whichever parser hwloc has. */
    snprintf(path, sizeof(path), "%s/bad.xml", dir);
    write_text(path, "<?xml version=\"1.0\"?>\n<not-a-topology/>\n");
    test_log_capture_start();
    cr_assert_eq(topo_open(path, &t), -EINVAL);
    cr_assert_null(t);
    cr_assert_eq(test_log_text()[0], '\0', "topo_open logs nothing: %s", test_log_text());
    test_log_capture_stop();
    why = open_error(path, -EINVAL);
    cr_assert(strstr(why, path) && strstr(why, "XML parser") && strstr(why, "HWLOC_XML_VERBOSE=1"),
              "%s", why);

    cr_assert_eq(topo_open(NULL, NULL), -EINVAL);
    cr_assert(strstr(open_error(NULL, -EIO), "this machine's topology"));
    topo_open_error(path, -EINVAL, NULL, 0);
    test_rmtree(dir);
}

/* Regression: two_nodes.xml once began with an XML comment, which hwloc's minimal parser
 * (all there is without Debian's libhwloc-plugins) refuses. HWLOC_LIBXML=0 forces that
 * parser; hwloc reads it once per process, and each Criterion test is a process. */
Test(topo, xml_loads_with_the_minimal_parser)
{
    struct topo *t;

    cr_assert_eq(setenv("HWLOC_LIBXML", "0", 1), 0);
    t = open_xml();
    cr_assert_eq(topo_numa_nodes(t), 2);
    cr_assert_eq(topo_pci_node(t, GPU), 1);
    cr_assert_eq(topo_pci_node(t, NVME), 0);
    topo_close(t);
}

Test(topo, minimal_parser_error_names_libhwloc_plugins)
{
    char *dir = test_tmpdir("minxml");
    char path[PATH_MAX];
    struct topo *t;

    cr_assert_eq(setenv("HWLOC_LIBXML", "0", 1), 0);
    write_commented_copy(dir, "commented.xml", path, sizeof(path));
    cr_assert_eq(topo_open(path, &t), -EINVAL);
    cr_assert(strstr(open_error(path, -EINVAL), "minimal XML parser") &&
                  strstr(open_error(path, -EINVAL), "no comments") &&
                  strstr(open_error(path, -EINVAL), "libhwloc-plugins"),
              "%s", open_error(path, -EINVAL));
    test_rmtree(dir);
}

/* The same file with libxml2, and a file only libxml2 reads (a comment): where hwloc has
 * the libxml2 parser, which Debian packages in libhwloc-plugins. */
Test(topo, xml_loads_with_libxml2)
{
    char *dir = test_tmpdir("libxml");
    char path[PATH_MAX];
    struct topo *t;
    int r;

    cr_assert_eq(setenv("HWLOC_LIBXML", "1", 1), 0);
    write_commented_copy(dir, "commented.xml", path, sizeof(path));
    r = topo_open(path, &t);
    if (r == -EINVAL) {
        cr_assert(strstr(open_error(path, r), "minimal XML parser"), "%s", open_error(path, r));
        test_rmtree(dir);
        cr_skip_test("hwloc has no libxml2 parser here (Debian: libhwloc-plugins)");
    }
    cr_assert_eq(r, 0, "%s", open_error(path, r));
    cr_assert_eq(topo_numa_nodes(t), 2);
    cr_assert_eq(topo_pci_node(t, GPU), 1);
    topo_close(t);

    t = open_xml();
    cr_assert_eq(topo_numa_nodes(t), 2);
    topo_close(t);

    snprintf(path, sizeof(path), "%s/bad.xml", dir);
    write_text(path, "<?xml version=\"1.0\"?>\n<not-a-topology/>\n");
    cr_assert_eq(topo_open(path, &t), -EINVAL);
    cr_assert(strstr(open_error(path, -EINVAL), "(libxml2)"), "%s", open_error(path, -EINVAL));
    test_rmtree(dir);
}

/* A thread's open of this machine; *(int *)res gets topo_open's result (Criterion's
 * asserts belong to the test's own thread). */
static void *open_this_machine(void *res)
{
    struct topo *t = NULL;
    struct topo_choice c;

    *(int *)res = topo_open(NULL, &t);
    topo_choose(t, NULL, NULL, &c);
    topo_close(t);
    return NULL;
}

/* How many times what occurs in text. */
static int count_of(const char *text, const char *what)
{
    int n = 0;
    for (const char *p = text; (p = strstr(p, what)); p += strlen(what))
        n++;
    return n;
}

/* Regression: every engine open loaded this machine's topology again, with every hwloc
 * component there is; where Debian's hwloc plugins are installed, "gl" opened X11
 * displays :0 to :9 and resolved names for each (a minute on a machine whose name
 * resolution was slow). Now only the Linux component runs, once per process, however
 * many threads open at once. hwloc tells which components it enables when
 * HWLOC_COMPONENTS_VERBOSE is set before its first use in the process. */
Test(topo, this_machine_is_loaded_once_without_extra_components)
{
    static const char *const unwanted[] = {"gl",   "opencl",    "cuda", "nvml",
                                           "rsmi", "levelzero", "pci",  "x86"};
    char *dir = test_tmpdir("verbose"), log[PATH_MAX], *text;
    pthread_t th[4];
    int res[ARRAY_SIZE(th) + 1];
    struct timespec t0, t1;
    int fd, saved;
    FILE *f;
    long n;

    cr_assert_eq(setenv("HWLOC_COMPONENTS_VERBOSE", "1", 1), 0);
    snprintf(log, sizeof(log), "%s/hwloc.log", dir);
    fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    cr_assert_geq(fd, 0);
    fflush(stderr);
    saved = dup(STDERR_FILENO);
    cr_assert_eq(dup2(fd, STDERR_FILENO), STDERR_FILENO);
    close(fd);
    for (size_t i = 0; i < ARRAY_SIZE(th); i++)
        cr_assert_eq(pthread_create(&th[i], NULL, open_this_machine, &res[i]), 0);
    for (size_t i = 0; i < ARRAY_SIZE(th); i++)
        pthread_join(th[i], NULL);
    open_this_machine(&res[ARRAY_SIZE(th)]);
    fflush(stderr);
    dup2(saved, STDERR_FILENO);
    close(saved);
    for (size_t i = 0; i < ARRAY_SIZE(res); i++)
        cr_assert_eq(res[i], 0, "open %zu: %s", i, strerror(-res[i]));

    f = fopen(log, "r");
    cr_assert(f);
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    rewind(f);
    text = calloc(1, (size_t)n + 1);
    cr_assert_eq(fread(text, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    if (!strstr(text, "Final list of enabled discovery components")) {
        free(text);
        test_rmtree(dir);
        cr_skip_test("this hwloc does not list the components it enables");
    }
    cr_assert_eq(count_of(text, "Final list of enabled discovery components"), 1,
                 "this machine was loaded more than once:\n%s", text);
    cr_assert_eq(count_of(text, "Enabling discovery component `linux'"), 1, "%s", text);
    for (size_t i = 0; i < ARRAY_SIZE(unwanted); i++) {
        char what[64];
        snprintf(what, sizeof(what), "Enabling discovery component `%s'", unwanted[i]);
        cr_assert(!strstr(text, what), "%s was enabled:\n%s", unwanted[i], text);
    }
    free(text);

    /* And so an open after the first costs next to nothing: a thousand in well under a
     * second, where each load of the machine took milliseconds or, probing X11, seconds. */
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < 1000; i++) {
        struct topo *t;
        cr_assert_eq(topo_open(NULL, &t), 0);
        topo_close(t);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
    cr_assert_lt(ms, 1000.0, "1000 opens took %.0f ms", ms);
    test_rmtree(dir);
}

/* This machine: whatever it is, the answers must be sane and nothing may crash. */
Test(topo, this_machine)
{
    struct topo *t = NULL;
    struct topo_choice c;
    int n, node;

    cr_assert_eq(topo_open(NULL, &t), 0);
    n = topo_numa_nodes(t);
    cr_assert_geq(n, 1);

    /* tmpfs, procfs and missing paths have no drive. */
    if (access("/dev/shm", F_OK) == 0) cr_assert_eq(topo_path_node(t, "/dev/shm"), -ENOENT);
    cr_assert_eq(topo_path_node(t, "/proc/self"), -ENOENT);
    cr_assert_eq(topo_path_node(t, "/no/such/path"), -ENOENT);
    node = topo_path_node(t, "/");
    cr_assert(node == -ENOENT || (node >= 0 && node <= numa_max_node()), "%d", node);
    node = topo_path_node(t, getenv("ZINF_TEST_TMPDIR") ? getenv("ZINF_TEST_TMPDIR") : "/tmp");
    cr_assert(node == -ENOENT || (node >= 0 && node <= numa_max_node()), "%d", node);
    cr_assert_eq(topo_pci_node(t, "ffff:ff:1f.7"), -ENOENT);

    topo_choose(t, NULL, NULL, &c);
    if (numa_available() < 0) {
        cr_assert_eq(c.reason, TOPO_NONE);
        cr_assert_eq(c.numa_node, -1);
    } else {
        cr_assert_eq(c.reason, TOPO_CALLER);
        cr_assert(c.numa_node >= 0 && c.numa_node <= numa_max_node(), "%d", c.numa_node);
    }
    cr_assert(c.detail[0], "a reason is always given");

    topo_choose(t, ABSENT, "/dev/shm", &c);
    cr_assert(c.reason == TOPO_CALLER || c.reason == TOPO_NONE);
    cr_assert(strstr(c.detail, ABSENT), "%s", c.detail);
    topo_close(t);
}

Test(topo, bind_thread_here)
{
    struct topo *t = NULL;
    struct topo_choice c;
    cpu_set_t s;

    if (numa_available() < 0) cr_skip_test("no NUMA support");
    cr_assert_eq(topo_open(NULL, &t), 0);
    topo_choose(t, NULL, NULL, &c);
    cr_assert_geq(c.numa_node, 0);
    cr_assert_eq(topo_bind_thread(t, c.numa_node), 0);

    /* The thread may now run only on CPUs of that node. */
    struct bitmask *cpus = numa_allocate_cpumask();
    cr_assert_eq(numa_node_to_cpus(c.numa_node, cpus), 0);
    cr_assert_eq(sched_getaffinity(0, sizeof(s), &s), 0);
    for (int cpu = 0; cpu < CPU_SETSIZE; cpu++)
        if (CPU_ISSET(cpu, &s))
            cr_assert(numa_bitmask_isbitset(cpus, (unsigned)cpu), "CPU %d", cpu);
    numa_free_cpumask(cpus);

    cr_assert_eq(topo_bind_thread(t, -1), 0);
    cr_assert_eq(topo_bind_thread(t, -2), -EINVAL);
    cr_assert_eq(topo_bind_thread(t, 4096), -EINVAL);
    topo_close(t);
}

Test(topo, print_this_machine)
{
    struct topo *t = NULL;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);

    cr_assert_eq(topo_open(NULL, &t), 0);
    topo_print(t, f);
    fclose(f);
    cr_assert(strstr(buf, "topology: this machine"), "%s", buf);
    cr_assert(strstr(buf, "node 0:") || numa_available() < 0, "%s", buf);
    cr_assert(strstr(buf, "GPUs:") && strstr(buf, "storage controllers:"), "%s", buf);
    free(buf);
    topo_close(t);
}
