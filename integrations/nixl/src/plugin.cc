// libplugin_R2CCL.so: NIXL's entry points (nixl_plugin_init, nixl_plugin_fini) for r2ccl's
// backend engine. NIXL names the backend after the file: R2CCL.
//
// NIXL's plugin API version (1) stays the same while the nixlBackendEngine class changes from
// release to release, so the plugin was built against one release's headers and refuses to load
// into another: it finds the libnixl.so that loads it and, in a pip install, the version of the
// wheel that holds it.
#include <dlfcn.h>
#include <fmt/format.h>
#include <link.h>

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <system_error>

#include "backend/backend_plugin.h"  // NIXL's (third_party/nixl-<version>)
#include "engine.h"
#include "r2ccl/runtime/config.h"
#include "r2ccl/runtime/log.h"

namespace r2ccl::nixl {
namespace {

namespace fs = std::filesystem;

// The libnixl.so of this process, if one is loaded.
std::optional<std::string> loaded_libnixl() {
  std::optional<std::string> found;
  dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* out) {
        if (info->dlpi_name == nullptr) return 0;
        const fs::path p(info->dlpi_name);
        if (p.filename() != "libnixl.so") return 0;
        *static_cast<std::optional<std::string>*>(out) = p.string();
        return 1;
      },
      &found);
  return found;
}

// The version of the NIXL wheel that holds `libnixl` (site-packages/.nixl_cu12.mesonpy.libs/
// libnixl.so belongs to site-packages/nixl_cu12-<version>.dist-info), or nothing when NIXL was
// installed otherwise.
std::optional<std::string> wheel_version(const fs::path& libnixl) {
  const std::string dir = libnixl.parent_path().filename().string();  // .nixl_cu12.mesonpy.libs
  const std::string suffix = ".mesonpy.libs";
  if (dir.size() <= suffix.size() + 1 || dir[0] != '.' ||
      dir.compare(dir.size() - suffix.size(), suffix.size(), suffix) != 0)
    return std::nullopt;
  const std::string package = dir.substr(1, dir.size() - 1 - suffix.size()) + "-";  // nixl_cu12-
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(libnixl.parent_path().parent_path(), ec)) {
    const std::string name = entry.path().filename().string();
    const std::string tail = ".dist-info";
    if (name.rfind(package, 0) == 0 && name.size() > package.size() + tail.size() &&
        name.compare(name.size() - tail.size(), tail.size(), tail) == 0)
      return name.substr(package.size(), name.size() - package.size() - tail.size());
  }
  return std::nullopt;
}

// Whether this build may load into the NIXL of this process; the error names both versions.
bool version_matches() {
  const auto lib = loaded_libnixl();
  if (!lib) return true;  // loaded by something else than NIXL (a test harness): nothing to match
  const auto version = wheel_version(*lib);
  if (!version) {
    R2CCL_INFO("nixl: cannot tell the version of {}; this plugin was built for NIXL {}", *lib,
               kNixlVersion);
    return true;
  }
  if (*version == kNixlVersion) return true;
  R2CCL_ERROR(
      "r2ccl's NIXL plugin was built for NIXL {} and does not load into NIXL {} ({}): NIXL's "
      "backend interface changes between releases. Install the r2ccl plugin built for NIXL {}, "
      "or NIXL {} (pip install nixl=={})",
      kNixlVersion, *version, *lib, *version, kNixlVersion, kNixlVersion);
  return false;
}

nixlBackendEngine* create_engine(const nixlBackendInitParams* params) {
  try {
    auto engine = std::make_unique<Engine>(params);
    return engine.release();  // NIXL hands it back to destroy_engine
  } catch (const std::exception& e) {
    R2CCL_ERROR("r2ccl NIXL backend: not created: {}", e.what());
    return nullptr;
  }
}

void destroy_engine(nixlBackendEngine* engine) {
  std::unique_ptr<nixlBackendEngine> owned(engine);
}

const char* plugin_name() {
  return "R2CCL";
}

const char* plugin_version() {
  return R2CCL_PLUGIN_VERSION;
}

// The R2CCL_* settings with their defaults, named as NIXL's custom parameters take them
// ("nics" for R2CCL_NICS); a parameter given when the backend is created wins over the
// environment.
nixl_b_params_t backend_options() {
  nixl_b_params_t out;
  try {
    for (const auto& e : config_table()) {
      std::string key = e.name;
      if (key.rfind("R2CCL_", 0) != 0) continue;
      key = key.substr(6);
      for (char& c : key)
        c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      out[key] = e.default_text;
    }
  } catch (...) {
    out.clear();
  }
  return out;
}

nixl_mem_list_t backend_mems() {
  return {DRAM_SEG, VRAM_SEG};
}

nixlBackendPlugin g_plugin = {NIXL_PLUGIN_API_VERSION, create_engine,   destroy_engine, plugin_name,
                              plugin_version,          backend_options, backend_mems};

}  // namespace
}  // namespace r2ccl::nixl

extern "C" NIXL_PLUGIN_EXPORT nixlBackendPlugin* nixl_plugin_init() {
  try {
    return r2ccl::nixl::version_matches() ? &r2ccl::nixl::g_plugin : nullptr;
  } catch (...) {
    return nullptr;
  }
}

extern "C" NIXL_PLUGIN_EXPORT void nixl_plugin_fini() {}
