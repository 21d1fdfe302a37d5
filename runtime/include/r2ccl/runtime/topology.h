// The NICs of this host and which of them this process uses as rails.
//
// Interfaces and addresses come from the kernel (getifaddrs, sysfs); NUMA node and PCI locality,
// and the verbs devices that sit on the same PCI function, from hwloc. Virtual NICs (veth, the
// testbed's) have no PCI parent: their locality is unknown (-1 / empty).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "r2ccl/runtime/status.h"

namespace r2ccl {

struct NetInterface {
  std::string name;
  std::string ipv4;  // first IPv4 address, empty if none
  bool up = false;   // administratively up and carrier present (IFF_RUNNING)
  bool loopback = false;
  int numa_node = -1;        // from hwloc; -1 when unknown
  std::string pci_bus_id;    // from hwloc, e.g. 0000:17:00.0; empty when not a PCI device
  std::string verbs_device;  // verbs device on the same PCI function (e.g. mlx5_0), if any
};

struct Topology {
  std::vector<NetInterface> interfaces;
  std::vector<std::string> verbs_devices;  // every verbs device hwloc reports
};

// Reads interfaces (always) and locality (hwloc; best effort, a failure only loses locality).
Result<Topology> discover_topology();

// The IPv4 address of interface `name`, or an error naming it.
Result<std::string> interface_ipv4(const std::string& name);

// The four bytes of a dotted-quad IPv4 address ("198.18.0.1": exactly four decimal numbers up to
// 255, nothing before, between or after them); nothing for anything else.
std::optional<std::array<std::uint8_t, 4>> parse_ipv4(std::string_view text);

// Every IPv4 address of this host's interfaces (in this network namespace), up or not; empty
// when the interfaces cannot be read.
std::vector<std::string> host_ipv4_addresses();

// Whether traffic to `ipv4` stays on this host: a loopback address (127.0.0.0/8), or one of
// host_ipv4_addresses(). The kernel loops such traffic back without it reaching any NIC.
bool is_host_address(const std::string& ipv4);

// A rail's local end: the NIC (or local address) a rail is bound to.
struct RailNic {
  std::string name;     // interface or verbs device name, or the address R2CCL_NICS gave
  std::string address;  // IPv4 address rails (and their probes) bind to
  int numa_node = -1;
  std::string pci_bus_id;
  std::string netdev;  // the kernel interface under it (link state, probes); empty: none known
};

// Chooses the rails. `requested` (R2CCL_NICS) lists interface names or local IPv4 addresses; when
// empty, every up interface with an IPv4 address except loopback and the interface that holds
// `control_address` is used. Errors name the entry that is wrong and what exists.
Result<std::vector<RailNic>> select_rails(const Topology& topo,
                                          const std::vector<std::string>& requested,
                                          const std::string& control_address);

}  // namespace r2ccl
