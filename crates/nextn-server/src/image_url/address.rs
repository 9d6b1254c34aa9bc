//! Which addresses an image URL may reach. A server that fetches URLs for its clients would
//! otherwise fetch its own loopback services, the private network it sits in, and the cloud
//! metadata endpoint (169.254.169.254) for anyone who can send a request: only public addresses
//! are fetched unless `--image-url-allow-private` says otherwise.
//!
//! "Public" is decided from IANA's special-purpose address registries (RFC 6890 and its updates):
//! every range that is not globally reachable is refused, and for IPv6 everything outside the
//! global unicast block 2000::/3 as well, so a range IANA reserves later is refused until it is
//! allocated. An IPv4 address written as IPv6 (IPv4-mapped, IPv4-translated, NAT64 64:ff9b::/96,
//! 6to4) is judged by the IPv4 address it carries.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

/// A range of addresses that is not public, as a refusal names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NonPublic {
    /// The range, in CIDR notation (`127.0.0.0/8`).
    pub range: &'static str,
    /// What the range is for (`loopback`).
    pub kind: &'static str,
    /// The IPv6 range that carried the IPv4 address in `range`, for an address such as
    /// `::ffff:127.0.0.1`.
    pub carried_by: Option<&'static str>,
}

impl fmt::Display for NonPublic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.range, self.kind)?;
        if let Some(outer) = self.carried_by {
            write!(f, " carried in {outer}")?;
        }
        Ok(())
    }
}

/// An IPv4 range: its first address, its prefix length, and how a refusal names it.
struct V4Range(u32, u8, &'static str, &'static str);
/// An IPv6 range, likewise.
struct V6Range(u128, u8, &'static str, &'static str);

/// IPv4 ranges that are not globally reachable (IANA's IPv4 special-purpose registry, plus
/// multicast); the first that contains an address names it.
const V4_NON_PUBLIC: &[V4Range] = &[
    V4Range(0x0000_0000, 8, "0.0.0.0/8", "this network"),
    V4Range(0x0a00_0000, 8, "10.0.0.0/8", "private"),
    V4Range(
        0x6440_0000,
        10,
        "100.64.0.0/10",
        "shared address space (CGNAT)",
    ),
    V4Range(0x7f00_0000, 8, "127.0.0.0/8", "loopback"),
    V4Range(0xa9fe_0000, 16, "169.254.0.0/16", "link-local"),
    V4Range(0xac10_0000, 12, "172.16.0.0/12", "private"),
    V4Range(0xc000_0000, 24, "192.0.0.0/24", "IETF protocol assignments"),
    V4Range(
        0xc000_0200,
        24,
        "192.0.2.0/24",
        "documentation (TEST-NET-1)",
    ),
    V4Range(
        0xc058_6300,
        24,
        "192.88.99.0/24",
        "6to4 relay anycast (deprecated)",
    ),
    V4Range(0xc0a8_0000, 16, "192.168.0.0/16", "private"),
    V4Range(0xc612_0000, 15, "198.18.0.0/15", "benchmarking"),
    V4Range(
        0xc633_6400,
        24,
        "198.51.100.0/24",
        "documentation (TEST-NET-2)",
    ),
    V4Range(
        0xcb00_7100,
        24,
        "203.0.113.0/24",
        "documentation (TEST-NET-3)",
    ),
    V4Range(0xe000_0000, 4, "224.0.0.0/4", "multicast"),
    V4Range(0xffff_ffff, 32, "255.255.255.255/32", "limited broadcast"),
    V4Range(0xf000_0000, 4, "240.0.0.0/4", "reserved"),
];

/// IPv6 ranges whose low 32 bits are an IPv4 address, judged by that address.
const V6_CARRYING_V4: &[V6Range] = &[
    V6Range(0xffff << 32, 96, "::ffff:0:0/96", "IPv4-mapped"),
    V6Range(0xffff << 48, 96, "::ffff:0:0:0/96", "IPv4-translated"),
    V6Range(0x0064_ff9b << 96, 96, "64:ff9b::/96", "NAT64"),
];

/// IPv6 ranges that are not globally reachable (IANA's IPv6 special-purpose registry, and the
/// blocks outside 2000::/3 a refusal is better off naming).
const V6_NON_PUBLIC: &[V6Range] = &[
    V6Range(0, 128, "::/128", "unspecified"),
    V6Range(1, 128, "::1/128", "loopback"),
    V6Range(0, 96, "::/96", "IPv4-compatible (deprecated)"),
    V6Range(
        0x0064_ff9b_0001 << 80,
        48,
        "64:ff9b:1::/48",
        "local-use NAT64",
    ),
    V6Range(0x0100 << 112, 64, "100::/64", "discard-only"),
    V6Range(0x2001_0db8 << 96, 32, "2001:db8::/32", "documentation"),
    V6Range(
        0x2001 << 112,
        23,
        "2001::/23",
        "IETF protocol assignments (Teredo, ORCHID, benchmarking)",
    ),
    V6Range(0x3fff << 112, 20, "3fff::/20", "documentation"),
    V6Range(0xfc00 << 112, 7, "fc00::/7", "unique local"),
    V6Range(0xfe80 << 112, 10, "fe80::/10", "link-local"),
    V6Range(0xfec0 << 112, 10, "fec0::/10", "site-local (deprecated)"),
    V6Range(0xff00 << 112, 8, "ff00::/8", "multicast"),
];

/// The global unicast block: IPv6 addresses outside it are not allocated for public use.
const V6_GLOBAL_UNICAST: V6Range = V6Range(0x2000 << 112, 3, "2000::/3", "global unicast");

/// 6to4: `2002:AABB:CCDD::/48` stands for the IPv4 address AA.BB.CC.DD.
const V6_6TO4: V6Range = V6Range(0x2002 << 112, 16, "2002::/16", "6to4");

fn in_v4(address: u32, network: u32, prefix: u8) -> bool {
    let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
    address & mask == network & mask
}

fn in_v6(address: u128, network: u128, prefix: u8) -> bool {
    let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
    address & mask == network & mask
}

fn non_public_v4(address: Ipv4Addr) -> Option<NonPublic> {
    let a = u32::from(address);
    V4_NON_PUBLIC
        .iter()
        .find(|r| in_v4(a, r.0, r.1))
        .map(|r| NonPublic {
            range: r.2,
            kind: r.3,
            carried_by: None,
        })
}

fn carried(v4: Ipv4Addr, outer: &V6Range) -> Option<NonPublic> {
    non_public_v4(v4).map(|inner| NonPublic {
        carried_by: Some(outer.2),
        ..inner
    })
}

fn non_public_v6(address: Ipv6Addr) -> Option<NonPublic> {
    let a = u128::from(address);
    if let Some(outer) = V6_CARRYING_V4.iter().find(|r| in_v6(a, r.0, r.1)) {
        return carried(Ipv4Addr::from(a as u32), outer);
    }
    if in_v6(a, V6_6TO4.0, V6_6TO4.1) {
        return carried(Ipv4Addr::from((a >> 80) as u32), &V6_6TO4);
    }
    let named = V6_NON_PUBLIC.iter().find(|r| in_v6(a, r.0, r.1));
    match named {
        Some(r) => Some(NonPublic {
            range: r.2,
            kind: r.3,
            carried_by: None,
        }),
        None if !in_v6(a, V6_GLOBAL_UNICAST.0, V6_GLOBAL_UNICAST.1) => Some(NonPublic {
            range: "outside 2000::/3",
            kind: "not allocated for global unicast",
            carried_by: None,
        }),
        None => None,
    }
}

/// The non-public range `address` is in, or `None` for a public address.
pub fn non_public(address: IpAddr) -> Option<NonPublic> {
    match address {
        IpAddr::V4(a) => non_public_v4(a),
        IpAddr::V6(a) => non_public_v6(a),
    }
}

/// A network given to `--image-url-allow-private=`: an address with a prefix length
/// (`10.1.0.0/16`, `fd00::/8`), or one address alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Network {
    address: IpAddr,
    prefix: u8,
}

/// Why a `--image-url-allow-private=` entry is not a network.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NetworkError {
    #[error("--image-url-allow-private: '{0}' is not an IP address or a network (such as 10.1.0.0/16, 192.168.1.20 or fd00::/8)")]
    Address(String),
    #[error("--image-url-allow-private: '{given}' has a prefix length over {max}")]
    Prefix { given: String, max: u8 },
    #[error("--image-url-allow-private: an empty network in the list")]
    Empty,
}

impl FromStr for Network {
    type Err = NetworkError;

    fn from_str(s: &str) -> Result<Self, NetworkError> {
        let s = s.trim();
        if s.is_empty() {
            return Err(NetworkError::Empty);
        }
        let (address, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let address: IpAddr = address
            .parse()
            .map_err(|_| NetworkError::Address(s.to_string()))?;
        let max = if address.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => match p.parse::<u8>() {
                Ok(p) if p <= max => p,
                Ok(_) => {
                    return Err(NetworkError::Prefix {
                        given: s.to_string(),
                        max,
                    })
                }
                Err(_) => return Err(NetworkError::Address(s.to_string())),
            },
        };
        Ok(match address.to_canonical() {
            // `::ffff:10.0.0.0/104` is 10.0.0.0/8.
            v4 @ IpAddr::V4(_) if address.is_ipv6() && prefix >= 96 => Network {
                address: v4,
                prefix: prefix - 96,
            },
            _ => Network { address, prefix },
        })
    }
}

impl fmt::Display for Network {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.address, self.prefix)
    }
}

impl Network {
    /// Whether `address` is in the network (an IPv4-mapped IPv6 address as its IPv4 address).
    pub fn contains(&self, address: IpAddr) -> bool {
        match (self.address, address.to_canonical()) {
            (IpAddr::V4(n), IpAddr::V4(a)) => in_v4(u32::from(a), u32::from(n), self.prefix),
            (IpAddr::V6(n), IpAddr::V6(a)) => in_v6(u128::from(a), u128::from(n), self.prefix),
            _ => false,
        }
    }
}

/// Which addresses image URLs may reach (`--image-url-allow-private`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum AddressPolicy {
    /// Public addresses only.
    #[default]
    PublicOnly,
    /// Every address (`--image-url-allow-private`).
    Any,
    /// Public addresses and these networks (`--image-url-allow-private=NET,...`).
    PublicAnd(Vec<Network>),
}

impl AddressPolicy {
    /// `--image-url-allow-private`'s value: empty for every address, else a comma-separated
    /// list of networks.
    pub fn parse_allowed(list: &str) -> Result<Self, NetworkError> {
        if list.trim().is_empty() {
            return Ok(AddressPolicy::Any);
        }
        list.split(',')
            .map(str::parse)
            .collect::<Result<Vec<Network>, _>>()
            .map(AddressPolicy::PublicAnd)
    }

    /// Whether a fetch may connect to `address`; the range that refuses it otherwise.
    pub fn check(&self, address: IpAddr) -> Result<(), NonPublic> {
        let Some(range) = non_public(address) else {
            return Ok(());
        };
        match self {
            AddressPolicy::PublicOnly => Err(range),
            AddressPolicy::Any => Ok(()),
            AddressPolicy::PublicAnd(allowed) if allowed.iter().any(|n| n.contains(address)) => {
                Ok(())
            }
            AddressPolicy::PublicAnd(_) => Err(range),
        }
    }
}

impl fmt::Display for AddressPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AddressPolicy::PublicOnly => f.write_str("public addresses only"),
            AddressPolicy::Any => f.write_str("any address (--image-url-allow-private)"),
            AddressPolicy::PublicAnd(nets) => {
                f.write_str("public addresses and ")?;
                for (k, n) in nets.iter().enumerate() {
                    if k > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{n}")?;
                }
                f.write_str(" (--image-url-allow-private)")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range_of(address: &str) -> Option<&'static str> {
        non_public(address.parse().unwrap()).map(|r| r.range)
    }

    #[test]
    fn every_non_public_ipv4_range_is_refused_at_both_ends() {
        for (first, last, range) in [
            ("0.0.0.0", "0.255.255.255", "0.0.0.0/8"),
            ("10.0.0.0", "10.255.255.255", "10.0.0.0/8"),
            ("100.64.0.0", "100.127.255.255", "100.64.0.0/10"),
            ("127.0.0.0", "127.255.255.255", "127.0.0.0/8"),
            ("169.254.0.0", "169.254.255.255", "169.254.0.0/16"),
            ("172.16.0.0", "172.31.255.255", "172.16.0.0/12"),
            ("192.0.0.0", "192.0.0.255", "192.0.0.0/24"),
            ("192.0.2.0", "192.0.2.255", "192.0.2.0/24"),
            ("192.88.99.0", "192.88.99.255", "192.88.99.0/24"),
            ("192.168.0.0", "192.168.255.255", "192.168.0.0/16"),
            ("198.18.0.0", "198.19.255.255", "198.18.0.0/15"),
            ("198.51.100.0", "198.51.100.255", "198.51.100.0/24"),
            ("203.0.113.0", "203.0.113.255", "203.0.113.0/24"),
            ("224.0.0.0", "239.255.255.255", "224.0.0.0/4"),
            ("240.0.0.0", "255.255.255.254", "240.0.0.0/4"),
            ("255.255.255.255", "255.255.255.255", "255.255.255.255/32"),
        ] {
            assert_eq!(range_of(first), Some(range), "{first}");
            assert_eq!(range_of(last), Some(range), "{last}");
            // Its IPv6 spellings: IPv4-mapped, IPv4-translated and NAT64 judged by the IPv4
            // address, IPv4-compatible refused as a whole.
            for v4 in [first, last] {
                for (v6, outer) in [
                    (format!("::ffff:{v4}"), Some("::ffff:0:0/96")),
                    (format!("::ffff:0:{v4}"), Some("::ffff:0:0:0/96")),
                    (format!("64:ff9b::{v4}"), Some("64:ff9b::/96")),
                ] {
                    let r = non_public(v6.parse().unwrap()).unwrap_or_else(|| panic!("{v6}"));
                    assert_eq!((r.range, r.carried_by), (range, outer), "{v6}");
                }
                let compatible = format!("::{v4}");
                let r = non_public(compatible.parse().unwrap());
                assert!(r.is_some(), "{compatible}");
            }
        }
        let metadata = non_public("169.254.169.254".parse().unwrap()).unwrap();
        assert_eq!(metadata.to_string(), "169.254.0.0/16 (link-local)");
    }

    #[test]
    fn public_ipv4_addresses_next_to_the_ranges_pass() {
        for public in [
            "1.1.1.1",
            "8.8.8.8",
            "9.255.255.255",
            "11.0.0.0",
            "100.63.255.255",
            "100.128.0.0",
            "126.255.255.255",
            "128.0.0.0",
            "169.253.255.255",
            "169.255.0.0",
            "172.15.255.255",
            "172.32.0.0",
            "192.0.1.0",
            "192.0.3.0",
            "192.167.255.255",
            "192.169.0.0",
            "198.17.255.255",
            "198.20.0.0",
            "198.51.99.255",
            "203.0.112.255",
            "223.255.255.255",
        ] {
            assert_eq!(range_of(public), None, "{public}");
        }
    }

    #[test]
    fn ipv6_special_ranges_are_refused() {
        for (address, range) in [
            ("::", "::/128"),
            ("::1", "::1/128"),
            ("::2", "::/96"),
            ("::8.8.8.8", "::/96"),
            ("::127.0.0.1", "::/96"),
            ("::10.0.0.1", "::/96"),
            ("::169.254.169.254", "::/96"),
            ("64:ff9b:1::1", "64:ff9b:1::/48"),
            ("100::1", "100::/64"),
            ("2001:db8::1", "2001:db8::/32"),
            ("2001:db8:ffff:ffff:ffff:ffff:ffff:ffff", "2001:db8::/32"),
            ("2001::1", "2001::/23"),
            ("2001:1ff:ffff::1", "2001::/23"),
            ("3fff::1", "3fff::/20"),
            ("3fff:fff:ffff::1", "3fff::/20"),
            ("fc00::1", "fc00::/7"),
            ("fd12:3456:789a::1", "fc00::/7"),
            ("fe80::1", "fe80::/10"),
            ("febf:ffff::1", "fe80::/10"),
            ("fec0::1", "fec0::/10"),
            ("ff02::1", "ff00::/8"),
            ("ff0e::1", "ff00::/8"),
            ("5f00::1", "outside 2000::/3"),
            ("4000::1", "outside 2000::/3"),
            ("1::1", "outside 2000::/3"),
            ("e000::1", "outside 2000::/3"),
        ] {
            assert_eq!(range_of(address), Some(range), "{address}");
        }
        for public in [
            "2606:4700:4700::1111",
            "2a00:1450:4001::1",
            "2001:200::1",
            "3ffe::1",
            "2001:db7:ffff::1",
            "2001:db9::1",
        ] {
            assert_eq!(range_of(public), None, "{public}");
        }
    }

    #[test]
    fn ipv4_carried_in_ipv6_is_judged_by_the_ipv4_address() {
        for (address, range, outer) in [
            ("::ffff:127.0.0.1", "127.0.0.0/8", "::ffff:0:0/96"),
            ("::ffff:7f00:1", "127.0.0.0/8", "::ffff:0:0/96"),
            ("::ffff:10.1.2.3", "10.0.0.0/8", "::ffff:0:0/96"),
            ("::ffff:169.254.169.254", "169.254.0.0/16", "::ffff:0:0/96"),
            ("::ffff:0.0.0.0", "0.0.0.0/8", "::ffff:0:0/96"),
            ("::ffff:0:192.168.1.1", "192.168.0.0/16", "::ffff:0:0:0/96"),
            ("64:ff9b::127.0.0.1", "127.0.0.0/8", "64:ff9b::/96"),
            ("64:ff9b::a00:1", "10.0.0.0/8", "64:ff9b::/96"),
            ("64:ff9b::100.64.0.1", "100.64.0.0/10", "64:ff9b::/96"),
            ("2002:7f00:1::1", "127.0.0.0/8", "2002::/16"),
            ("2002:c0a8:101::", "192.168.0.0/16", "2002::/16"),
        ] {
            let r = non_public(address.parse().unwrap()).unwrap_or_else(|| panic!("{address}"));
            assert_eq!((r.range, r.carried_by), (range, Some(outer)), "{address}");
        }
        let r = non_public("::ffff:127.0.0.1".parse().unwrap()).unwrap();
        assert_eq!(
            r.to_string(),
            "127.0.0.0/8 (loopback) carried in ::ffff:0:0/96"
        );
        for public in ["::ffff:8.8.8.8", "64:ff9b::808:808", "2002:808:808::1"] {
            assert_eq!(range_of(public), None, "{public}");
        }
    }

    #[test]
    fn networks_parse_and_contain() {
        let n: Network = "10.1.0.0/16".parse().unwrap();
        assert!(n.contains("10.1.255.1".parse().unwrap()));
        assert!(n.contains("::ffff:10.1.0.9".parse().unwrap()));
        assert!(!n.contains("10.2.0.1".parse().unwrap()));
        assert!(!n.contains("::1".parse().unwrap()));
        let one: Network = "127.0.0.1".parse().unwrap();
        assert_eq!(one.to_string(), "127.0.0.1/32");
        assert!(one.contains("127.0.0.1".parse().unwrap()));
        assert!(!one.contains("127.0.0.2".parse().unwrap()));
        let v6: Network = "fd00::/8".parse().unwrap();
        assert!(v6.contains("fd12::1".parse().unwrap()));
        assert!(!v6.contains("fe80::1".parse().unwrap()));
        let mapped: Network = "::ffff:10.0.0.0/104".parse().unwrap();
        assert_eq!(mapped.to_string(), "10.0.0.0/8");
        let all: Network = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("192.168.1.1".parse().unwrap()));
        for (bad, words) in [
            ("10.0.0.0/33", "prefix length over 32"),
            ("::/129", "prefix length over 128"),
            ("localhost", "not an IP address"),
            ("10.0.0.0/x", "not an IP address"),
            ("10.0.0/8", "not an IP address"),
            ("", "empty"),
        ] {
            let e = bad.parse::<Network>().unwrap_err().to_string();
            assert!(e.starts_with("--image-url-allow-private: "), "{e}");
            assert!(e.contains(words), "{bad}: {e}");
        }
    }

    #[test]
    fn the_policy_refuses_non_public_addresses_unless_allowed() {
        let loopback: IpAddr = "127.0.0.1".parse().unwrap();
        let other: IpAddr = "127.0.0.2".parse().unwrap();
        let public: IpAddr = "93.184.215.14".parse().unwrap();
        let strict = AddressPolicy::PublicOnly;
        assert_eq!(strict.check(public), Ok(()));
        assert_eq!(strict.check(loopback).unwrap_err().range, "127.0.0.0/8");
        assert_eq!(AddressPolicy::Any.check(loopback), Ok(()));
        assert_eq!(AddressPolicy::parse_allowed(""), Ok(AddressPolicy::Any));
        let some = AddressPolicy::parse_allowed("127.0.0.1, 10.0.0.0/8").unwrap();
        assert_eq!(some.check(loopback), Ok(()));
        assert_eq!(some.check("::ffff:127.0.0.1".parse().unwrap()), Ok(()));
        assert_eq!(some.check("10.9.8.7".parse().unwrap()), Ok(()));
        assert_eq!(some.check(public), Ok(()));
        assert!(some.check(other).is_err());
        assert!(some.check("169.254.169.254".parse().unwrap()).is_err());
        assert_eq!(
            some.to_string(),
            "public addresses and 127.0.0.1/32, 10.0.0.0/8 (--image-url-allow-private)"
        );
        assert!(AddressPolicy::parse_allowed("127.0.0.1,,10.0.0.0/8").is_err());
    }
}
