#include "r2ccl/runtime/topology.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <hwloc.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include <algorithm>
#include <memory>

#include "r2ccl/runtime/log.h"

namespace r2ccl {
namespace {

struct IfaddrsDeleter {
  void operator()(ifaddrs* p) const { freeifaddrs(p); }
};
struct HwlocDeleter {
  void operator()(hwloc_topology* t) const { hwloc_topology_destroy(t); }
};

std::string ipv4_text(const sockaddr* sa) {
  char buf[INET_ADDRSTRLEN] = {};
  const auto* in = reinterpret_cast<const sockaddr_in*>(sa);
  inet_ntop(AF_INET, &in->sin_addr, buf, sizeof buf);
  return buf;
}

Result<std::vector<NetInterface>> kernel_interfaces() {
  ifaddrs* raw = nullptr;
  if (getifaddrs(&raw) != 0)
    return Status(ErrorCode::kNetwork, fmt::format("getifaddrs failed: {}", std::strerror(errno)));
  std::unique_ptr<ifaddrs, IfaddrsDeleter> list(raw);
  std::vector<NetInterface> out;
  for (ifaddrs* a = raw; a != nullptr; a = a->ifa_next) {
    std::string name = a->ifa_name;
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& i) { return i.name == name; });
    if (it == out.end()) {
      NetInterface ni;
      ni.name = name;
      ni.up = (a->ifa_flags & IFF_UP) && (a->ifa_flags & IFF_RUNNING);
      ni.loopback = (a->ifa_flags & IFF_LOOPBACK) != 0;
      out.push_back(ni);
      it = out.end() - 1;
    }
    if (a->ifa_addr != nullptr && a->ifa_addr->sa_family == AF_INET && it->ipv4.empty())
      it->ipv4 = ipv4_text(a->ifa_addr);
  }
  return out;
}

void add_locality(Topology& topo) {
  hwloc_topology_t raw = nullptr;
  if (hwloc_topology_init(&raw) != 0) return;
  std::unique_ptr<hwloc_topology, HwlocDeleter> t(raw);
  hwloc_topology_set_io_types_filter(raw, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  if (hwloc_topology_load(raw) != 0) {
    R2CCL_DEBUG("hwloc could not load the topology; NIC locality unknown");
    return;
  }
  struct Found {
    std::string pci;
    int numa;
  };
  auto locate = [&](hwloc_obj_t osdev) {
    Found f{"", -1};
    hwloc_obj_t parent = osdev->parent;
    if (parent != nullptr && parent->type == HWLOC_OBJ_PCI_DEVICE) {
      f.pci = fmt::format("{:04x}:{:02x}:{:02x}.{:x}", parent->attr->pcidev.domain,
                          parent->attr->pcidev.bus, parent->attr->pcidev.dev,
                          parent->attr->pcidev.func);
    }
    hwloc_obj_t cpu_parent = hwloc_get_non_io_ancestor_obj(raw, osdev);
    if (cpu_parent != nullptr && cpu_parent->nodeset != nullptr &&
        hwloc_bitmap_weight(cpu_parent->nodeset) == 1)
      f.numa = hwloc_bitmap_first(cpu_parent->nodeset);
    return f;
  };
  std::vector<std::pair<std::string, Found>> verbs;
  for (hwloc_obj_t o = hwloc_get_next_osdev(raw, nullptr); o != nullptr;
       o = hwloc_get_next_osdev(raw, o)) {
    if (o->name == nullptr) continue;
    const Found f = locate(o);
    if (o->attr->osdev.type == HWLOC_OBJ_OSDEV_OPENFABRICS) {
      topo.verbs_devices.push_back(o->name);
      verbs.emplace_back(o->name, f);
    } else if (o->attr->osdev.type == HWLOC_OBJ_OSDEV_NETWORK) {
      for (auto& ni : topo.interfaces) {
        if (ni.name != o->name) continue;
        ni.pci_bus_id = f.pci;
        ni.numa_node = f.numa;
      }
    }
  }
  for (auto& ni : topo.interfaces)
    for (const auto& [name, f] : verbs)
      if (!ni.pci_bus_id.empty() && f.pci == ni.pci_bus_id) ni.verbs_device = name;
}

// Whether `ip` is an address of this host (bind succeeds): true for all of 127.0.0.0/8.
bool is_local_ipv4(const std::string& ip) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  if (inet_pton(AF_INET, ip.c_str(), &sa.sin_addr) != 1) return false;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0;
  ::close(fd);
  return ok;
}

bool looks_like_ipv4(const std::string& s) {
  return parse_ipv4(s).has_value();
}

}  // namespace

std::optional<std::array<std::uint8_t, 4>> parse_ipv4(std::string_view text) {
  // inet_pton reads a C string: a NUL inside would end it early, and more than 15 characters
  // cannot be an address.
  if (text.size() > 15 || text.find('\0') != std::string_view::npos) return std::nullopt;
  const std::string s(text);
  in_addr a{};
  if (inet_pton(AF_INET, s.c_str(), &a) != 1) return std::nullopt;
  std::array<std::uint8_t, 4> out{};
  std::memcpy(out.data(), &a.s_addr, out.size());  // network order: the first number first
  return out;
}

Result<Topology> discover_topology() {
  Topology topo;
  R2CCL_ASSIGN_OR_RETURN(topo.interfaces, kernel_interfaces());
  add_locality(topo);
  return topo;
}

Result<std::string> interface_ipv4(const std::string& name) {
  R2CCL_ASSIGN_OR_RETURN(auto list, kernel_interfaces());
  for (const auto& i : list) {
    if (i.name != name) continue;
    if (i.ipv4.empty())
      return Status(ErrorCode::kNotFound, fmt::format("interface '{}' has no IPv4 address", name));
    return i.ipv4;
  }
  std::vector<std::string> names;
  for (const auto& i : list)
    names.push_back(i.name);
  return Status(ErrorCode::kNotFound, fmt::format("no interface named '{}' on this host (have: {})",
                                                  name, fmt::join(names, ", ")));
}

std::vector<std::string> host_ipv4_addresses() {
  std::vector<std::string> out;
  ifaddrs* raw = nullptr;
  if (getifaddrs(&raw) != 0) return out;
  std::unique_ptr<ifaddrs, IfaddrsDeleter> list(raw);
  for (ifaddrs* a = raw; a != nullptr; a = a->ifa_next)
    if (a->ifa_addr != nullptr && a->ifa_addr->sa_family == AF_INET)
      out.push_back(ipv4_text(a->ifa_addr));
  return out;
}

bool is_host_address(const std::string& ipv4) {
  if (ipv4.rfind("127.", 0) == 0) return true;
  const auto mine = host_ipv4_addresses();
  return !ipv4.empty() && std::find(mine.begin(), mine.end(), ipv4) != mine.end();
}

Result<std::vector<RailNic>> select_rails(const Topology& topo,
                                          const std::vector<std::string>& requested,
                                          const std::string& control_address) {
  std::vector<RailNic> rails;
  auto to_rail = [](const NetInterface& i) {
    return RailNic{i.name, i.ipv4, i.numa_node, i.pci_bus_id, i.name};
  };
  std::vector<std::string> usable;
  for (const auto& i : topo.interfaces)
    if (!i.ipv4.empty()) usable.push_back(i.name);

  if (!requested.empty()) {
    for (const auto& want : requested) {
      auto it = std::find_if(topo.interfaces.begin(), topo.interfaces.end(),
                             [&](const auto& i) { return i.name == want; });
      if (it != topo.interfaces.end()) {
        if (it->ipv4.empty())
          return Status(ErrorCode::kConfig,
                        fmt::format("R2CCL_NICS: interface '{}' has no IPv4 address", want));
        rails.push_back(to_rail(*it));
        continue;
      }
      if (looks_like_ipv4(want)) {
        if (!is_local_ipv4(want))
          return Status(ErrorCode::kConfig,
                        fmt::format("R2CCL_NICS: '{}' is not an address of this host", want));
        auto owner = std::find_if(topo.interfaces.begin(), topo.interfaces.end(),
                                  [&](const auto& i) { return i.ipv4 == want; });
        RailNic r{want, want, -1, "", ""};
        if (owner != topo.interfaces.end())
          r = RailNic{want, want, owner->numa_node, owner->pci_bus_id, ""};
        rails.push_back(r);
        continue;
      }
      return Status(ErrorCode::kConfig,
                    fmt::format("R2CCL_NICS: no interface named '{}' on this host (interfaces with "
                                "an IPv4 address: {})",
                                want, fmt::join(usable, ", ")));
    }
    return rails;
  }
  // A NIC that is down (no carrier, or set down) is a rail too: it joins once its link answers,
  // and rail i pairs NIC i of every host, so no host may leave one out.
  for (const auto& i : topo.interfaces) {
    if (i.loopback || i.ipv4.empty() || i.ipv4 == control_address) continue;
    if (!i.up)
      R2CCL_WARN("NIC {} ({}) is down: it is used as a rail once its link is up", i.name, i.ipv4);
    rails.push_back(to_rail(i));
  }
  if (rails.empty())
    return Status(ErrorCode::kUnavailable,
                  fmt::format("no NIC to use as a rail: no interface with an IPv4 address other "
                              "than loopback and the control interface ({}); set R2CCL_NICS",
                              control_address.empty() ? "none" : control_address));
  return rails;
}

}  // namespace r2ccl
