/* A fake libnvidia-ml.so.1 for tests: answers like NVML with NVML's own structs, return
 * codes and versioned symbol names, from a scenario file the test writes (and may rewrite
 * while nnui runs: it is re-read whenever its mtime, size or inode change).
 *
 * Scenario: $FAKE_NVML_SCENARIO, one record per line, tab-separated `key=value` fields after
 * the record kind (tests/fake_nvml/scenario.py writes it from a dict). Kinds:
 *   gpu   index name uuid bus_id domain bus device mem_total mem_used util temp power_mw
 *         limit_mw fan mig max_mig grow   (one per GPU, NVML index order = line order)
 *   mig   gpu slot uuid mem_total mem_used  (a MIG device of GPU `gpu`, at `slot`)
 *   proc  gpu pid used [mig] [graphics]     (used=-1: NVML_VALUE_NOT_AVAILABLE)
 *   err   gpu fn code                       (gpu=-1: library-wide; fn=*: every function)
 * A missing field reads as 0; `fan=-1`, `limit_mw=-1`... any -1 number means "not supported".
 * `grow=K`: K more processes appear at the first fill call of the process list, so the size
 * the caller asked for first is too small (the resize path).
 * $FAKE_NVML_LOG, when set, gets one line per call: `<function> <return code>`.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0, NVML_ERROR_UNINITIALIZED = 1, NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3, NVML_ERROR_NOT_FOUND = 6, NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9, NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25, NVML_ERROR_UNKNOWN = 999,
};

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct {
    unsigned version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
#define nvmlMemory_v2 (unsigned)(sizeof(nvmlMemory_v2_t) | (2 << 24))
typedef struct { unsigned gpu, memory; } nvmlUtilization_t;
typedef struct {
    unsigned pid;
    unsigned long long usedGpuMemory;
    unsigned gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;
typedef struct {
    char busIdLegacy[16];
    unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

#define MAX_GPUS 16
#define MAX_MIG 7
#define MAX_PROCS 256
#define MAX_ERRS 64
#define TEXT 96

struct device {
    int present, is_mig, index, slot;  /* slot: MIG position on the parent */
    struct device *parent;
    char name[TEXT], uuid[TEXT], bus_id[32];
    long long domain, bus, dev, mem_total, mem_used, util, temp, power_mw, limit_mw, fan;
    long long mig_mode, max_mig, grow;
    int grown;
};
struct proc { int gpu, mig, graphics; long long pid, used; };
struct err { int gpu; char fn[64]; int code; };

static struct device gpus[MAX_GPUS];
static struct device migs[MAX_GPUS][MAX_MIG];
static struct proc procs[MAX_PROCS];
static struct err errs[MAX_ERRS];
static int num_gpus, num_procs, num_errs, initialised;
static struct stat seen;
static char seen_path[4096];

static const char *field(const char *line, const char *key, char *out, size_t size) {
    size_t n = strlen(key);
    for (const char *p = line; p && *p; p = strchr(p, '\t')) {
        if (*p == '\t') p++;
        if (strncmp(p, key, n) == 0 && p[n] == '=') {
            const char *v = p + n + 1, *end = strpbrk(v, "\t\n");
            size_t len = end ? (size_t)(end - v) : strlen(v);
            if (len >= size) len = size - 1;
            memcpy(out, v, len);
            out[len] = 0;
            return out;
        }
    }
    out[0] = 0;
    return NULL;
}

static long long number(const char *line, const char *key) {
    char text[64];
    return field(line, key, text, sizeof text) ? strtoll(text, NULL, 10) : 0;
}

static void parse_line(const char *line) {
    if (strncmp(line, "gpu\t", 4) == 0 && num_gpus < MAX_GPUS) {
        struct device *d = &gpus[num_gpus];
        memset(d, 0, sizeof *d);
        d->present = 1, d->index = num_gpus++;
        field(line, "name", d->name, TEXT), field(line, "uuid", d->uuid, TEXT);
        field(line, "bus_id", d->bus_id, sizeof d->bus_id);
        d->domain = number(line, "domain"), d->bus = number(line, "bus");
        d->dev = number(line, "device"), d->mem_total = number(line, "mem_total");
        d->mem_used = number(line, "mem_used"), d->util = number(line, "util");
        d->temp = number(line, "temp"), d->power_mw = number(line, "power_mw");
        d->limit_mw = number(line, "limit_mw"), d->fan = number(line, "fan");
        d->mig_mode = number(line, "mig"), d->max_mig = number(line, "max_mig");
        d->grow = number(line, "grow");
    } else if (strncmp(line, "mig\t", 4) == 0) {
        long long g = number(line, "gpu"), s = number(line, "slot");
        if (g < 0 || g >= MAX_GPUS || s < 0 || s >= MAX_MIG) return;
        struct device *m = &migs[g][s];
        memset(m, 0, sizeof *m);
        m->present = 1, m->is_mig = 1, m->index = (int)g, m->slot = (int)s, m->parent = &gpus[g];
        field(line, "uuid", m->uuid, TEXT);
        snprintf(m->name, TEXT, "MIG device %lld/%lld", g, s);
        m->mem_total = number(line, "mem_total"), m->mem_used = number(line, "mem_used");
    } else if (strncmp(line, "proc\t", 5) == 0 && num_procs < MAX_PROCS) {
        struct proc *p = &procs[num_procs++];
        char text[8];
        p->gpu = (int)number(line, "gpu"), p->pid = number(line, "pid");
        p->used = number(line, "used"), p->graphics = (int)number(line, "graphics");
        p->mig = field(line, "mig", text, sizeof text) ? atoi(text) : -1;
    } else if (strncmp(line, "err\t", 4) == 0 && num_errs < MAX_ERRS) {
        struct err *e = &errs[num_errs++];
        e->gpu = (int)number(line, "gpu"), e->code = (int)number(line, "code");
        field(line, "fn", e->fn, sizeof e->fn);
    }
}

/* Re-read the scenario when the file changed (a test rewrites it with os.replace). */
static void load(void) {
    const char *path = getenv("FAKE_NVML_SCENARIO");
    struct stat now;
    if (!path || stat(path, &now) != 0) return;
    if (strcmp(path, seen_path) == 0 && now.st_ino == seen.st_ino && now.st_size == seen.st_size &&
        now.st_mtim.tv_sec == seen.st_mtim.tv_sec && now.st_mtim.tv_nsec == seen.st_mtim.tv_nsec)
        return;
    FILE *file = fopen(path, "r");
    if (!file) return;
    seen = now;
    snprintf(seen_path, sizeof seen_path, "%s", path);
    num_gpus = num_procs = num_errs = 0;
    memset(gpus, 0, sizeof gpus), memset(migs, 0, sizeof migs);
    char line[1024];
    while (fgets(line, sizeof line, file)) parse_line(line);
    fclose(file);
}

static nvmlReturn_t logged(const char *fn, nvmlReturn_t ret) {
    const char *path = getenv("FAKE_NVML_LOG");
    FILE *file = path ? fopen(path, "a") : NULL;
    if (file) fprintf(file, "%s %d\n", fn, ret), fclose(file);
    return ret;
}

/* The scenario's error for fn on GPU gpu (-1: library-wide), or NVML_SUCCESS. */
static nvmlReturn_t scripted(const char *fn, int gpu) {
    for (int i = 0; i < num_errs; i++)
        if (errs[i].gpu == gpu && (strcmp(errs[i].fn, fn) == 0 || strcmp(errs[i].fn, "*") == 0))
            return errs[i].code;
    return NVML_SUCCESS;
}

/* Common entry of a device query: initialised, a handle we gave out, no scripted error. */
static nvmlReturn_t enter(const char *fn, struct device *d) {
    load();
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    int known = 0;
    for (int g = 0; g < num_gpus && !known; g++) {
        known = d == &gpus[g];
        for (int s = 0; s < MAX_MIG && !known; s++) known = d == &migs[g][s] && d->present;
    }
    if (!known) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t ret = scripted(fn, d->index);
    return ret != NVML_SUCCESS ? ret : scripted(fn, -1);
}

#define ENTER(d)                                                        \
    do {                                                                \
        nvmlReturn_t ret_ = enter(__func__, (struct device *)(d));     \
        if (ret_ != NVML_SUCCESS) return logged(__func__, ret_);       \
    } while (0)
#define NOT_SUPPORTED_IF(cond) \
    do { if (cond) return logged(__func__, NVML_ERROR_NOT_SUPPORTED); } while (0)
#define OK() logged(__func__, NVML_SUCCESS)

nvmlReturn_t nvmlInitWithFlags(unsigned flags) {
    (void)flags;
    load();
    nvmlReturn_t ret = scripted(__func__, -1);
    if (ret == NVML_SUCCESS) initialised++;
    return logged(__func__, ret);
}
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlShutdown(void) {
    if (!initialised) return logged(__func__, NVML_ERROR_UNINITIALIZED);
    initialised--;
    return OK();
}

const char *nvmlErrorString(nvmlReturn_t ret) {
    switch (ret) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned length) {
    load();
    if (!initialised) return logged(__func__, NVML_ERROR_UNINITIALIZED);
    snprintf(version, length, "%s", "550.90.07");
    return OK();
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *count) {
    load();
    if (!initialised) return logged(__func__, NVML_ERROR_UNINITIALIZED);
    nvmlReturn_t ret = scripted(__func__, -1);
    if (ret == NVML_SUCCESS) *count = (unsigned)num_gpus;
    return logged(__func__, ret);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned index, struct device **device) {
    load();
    if (!initialised) return logged(__func__, NVML_ERROR_UNINITIALIZED);
    if (index >= (unsigned)num_gpus) return logged(__func__, NVML_ERROR_INVALID_ARGUMENT);
    nvmlReturn_t ret = scripted(__func__, (int)index);
    if (ret == NVML_SUCCESS) *device = &gpus[index];
    return logged(__func__, ret);
}

nvmlReturn_t nvmlDeviceGetName(struct device *d, char *name, unsigned length) {
    ENTER(d);
    if (strlen(d->name) >= length) return logged(__func__, NVML_ERROR_INSUFFICIENT_SIZE);
    strcpy(name, d->name);
    return OK();
}

nvmlReturn_t nvmlDeviceGetUUID(struct device *d, char *uuid, unsigned length) {
    ENTER(d);
    if (strlen(d->uuid) >= length) return logged(__func__, NVML_ERROR_INSUFFICIENT_SIZE);
    strcpy(uuid, d->uuid);
    return OK();
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(struct device *d, nvmlPciInfo_t *pci) {
    ENTER(d);
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busId, sizeof pci->busId, "%s", d->bus_id);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%.15s", d->bus_id + 4);
    pci->domain = (unsigned)d->domain, pci->bus = (unsigned)d->bus, pci->device = (unsigned)d->dev;
    pci->pciDeviceId = 0x233510DE;
    return OK();
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(struct device *d, nvmlMemory_t *memory) {
    ENTER(d);
    memory->total = (unsigned long long)d->mem_total;
    memory->used = (unsigned long long)d->mem_used;
    memory->free = memory->total - memory->used;
    return OK();
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(struct device *d, nvmlMemory_v2_t *memory) {
    ENTER(d);
    if (memory->version != nvmlMemory_v2)
        return logged(__func__, NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    memory->total = (unsigned long long)d->mem_total, memory->reserved = 0;
    memory->used = (unsigned long long)d->mem_used;
    memory->free = memory->total - memory->used;
    return OK();
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(struct device *d, nvmlUtilization_t *util) {
    ENTER(d);
    NOT_SUPPORTED_IF(d->is_mig || d->mig_mode > 0 || d->util < 0);  /* as on a MIG-enabled GPU */
    util->gpu = (unsigned)d->util, util->memory = (unsigned)d->util / 2;
    return OK();
}

nvmlReturn_t nvmlDeviceGetTemperature(struct device *d, int sensor, unsigned *temp) {
    ENTER(d);
    NOT_SUPPORTED_IF(d->is_mig || d->temp < 0 || sensor != 0);
    *temp = (unsigned)d->temp;
    return OK();
}

nvmlReturn_t nvmlDeviceGetPowerUsage(struct device *d, unsigned *milliwatts) {
    ENTER(d);
    NOT_SUPPORTED_IF(d->is_mig || d->power_mw < 0);
    *milliwatts = (unsigned)d->power_mw;
    return OK();
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(struct device *d, unsigned *limit) {
    ENTER(d);
    NOT_SUPPORTED_IF(d->is_mig || d->limit_mw < 0);
    *limit = (unsigned)d->limit_mw;
    return OK();
}

nvmlReturn_t nvmlDeviceGetFanSpeed(struct device *d, unsigned *speed) {
    ENTER(d);
    NOT_SUPPORTED_IF(d->is_mig || d->fan < 0);
    *speed = (unsigned)d->fan;
    return OK();
}

nvmlReturn_t nvmlDeviceGetMigMode(struct device *d, unsigned *current, unsigned *pending) {
    ENTER(d);
    NOT_SUPPORTED_IF(d->is_mig || d->mig_mode < 0);  /* -1: a GPU without MIG (pre-A100) */
    *current = *pending = (unsigned)d->mig_mode;
    return OK();
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(struct device *d, unsigned *count) {
    ENTER(d);
    NOT_SUPPORTED_IF(d->is_mig || d->mig_mode < 0);
    *count = (unsigned)d->max_mig;
    return OK();
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(struct device *d, unsigned index,
                                                 struct device **mig) {
    ENTER(d);
    NOT_SUPPORTED_IF(d->is_mig || d->mig_mode <= 0);
    if (index >= (unsigned)d->max_mig || index >= MAX_MIG)
        return logged(__func__, NVML_ERROR_INVALID_ARGUMENT);
    if (!migs[d->index][index].present) return logged(__func__, NVML_ERROR_NOT_FOUND);
    *mig = &migs[d->index][index];
    return OK();
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(struct device *d, unsigned *is_mig) {
    ENTER(d);
    *is_mig = (unsigned)d->is_mig;
    return OK();
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(struct device *d, struct device **out) {
    ENTER(d);
    if (!d->is_mig) return logged(__func__, NVML_ERROR_INVALID_ARGUMENT);
    *out = d->parent;
    return OK();
}

/* NVML's list protocol: too small a buffer (or none) answers INSUFFICIENT_SIZE with the
 * count needed; a MIG handle lists its own processes, the parent lists all of them. */
static nvmlReturn_t list_processes(const char *fn, struct device *d, unsigned *count,
                                   nvmlProcessInfo_t *infos, int graphics) {
    nvmlReturn_t ret = enter(fn, d);
    if (ret != NVML_SUCCESS) return logged(fn, ret);
    struct device *gpu = d->is_mig ? d->parent : d;
    if (infos && !graphics && gpu->grow && !gpu->grown) {
        gpu->grown = 1;  /* processes started between the caller's two calls */
        for (long long i = 0; i < gpu->grow && num_procs < MAX_PROCS; i++)
            procs[num_procs++] = (struct proc){gpu->index, -1, 0, 7000000 + i, 1 << 20};
    }
    unsigned needed = 0;
    for (int i = 0; i < num_procs; i++) {
        struct proc *p = &procs[i];
        if (p->gpu != d->index || p->graphics != graphics) continue;
        if (d->is_mig && p->mig != d->slot) continue;
        if (infos && needed < *count) {
            nvmlProcessInfo_t *info = &infos[needed];
            info->pid = (unsigned)p->pid;
            info->usedGpuMemory = (unsigned long long)p->used;  /* -1: not available */
            info->gpuInstanceId = p->mig < 0 ? 0xFFFFFFFFu : (unsigned)p->mig;
            info->computeInstanceId = p->mig < 0 ? 0xFFFFFFFFu : 0;
        }
        needed++;
    }
    if (needed == 0) {
        *count = 0;
        return logged(fn, NVML_SUCCESS);
    }
    if (!infos || *count < needed) {
        *count = needed;
        return logged(fn, NVML_ERROR_INSUFFICIENT_SIZE);
    }
    *count = needed;
    return logged(fn, NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(struct device *d, unsigned *count,
                                                     nvmlProcessInfo_t *infos) {
    return list_processes(__func__, d, count, infos, 0);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(struct device *d, unsigned *count,
                                                      nvmlProcessInfo_t *infos) {
    return list_processes(__func__, d, count, infos, 1);
}
