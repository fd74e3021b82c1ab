// The shared tier's pass over the pool's directory, in three steps: scan (what is there: every
// layout's files, this layout's verified blocks, what dead writers left), choose (the least
// recently read files above the watermark, sparing pinned ones) and take aside (rename, read
// the pins again, put back what was pinned meanwhile, delete the rest). No link is followed:
// every name is resolved beneath the pool's directory fd (store/shared_files.h).
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "base/log.h"
#include "store/shared_tier_impl.h"

namespace tpusync {
namespace {

bool IsDir(const shared::TierDir& dir, const shared::TierDir::Entry& e) {
  struct stat st{};
  return e.type == DT_DIR || (e.type == DT_UNKNOWN && dir.Stat(e.name, &st) && S_ISDIR(st.st_mode));
}

}  // namespace

struct SharedTier::Scan {
  struct File {
    int64_t atime;
    uint64_t bytes;
    std::string layout, name;  // the layout's directory name; name: <kk>/<key>
  };
  std::unordered_map<std::string, shared::TierDir> layouts;  // the pool's layout directories, opened
  std::vector<File> files;                                   // every regular file in a <kk> directory
  std::vector<std::pair<int64_t, BlockKey>> blocks;          // this layout's verified blocks, with their atime
  uint64_t used = 0, stale = 0;
};

SharedTier::Scan SharedTier::ScanPool(int64_t now_s, int64_t ttl_s) {
  Scan scan;
  const Files& f = *files_;
  const std::string own = Hex16(f.keys.fingerprint());
  // Records whose block never came or left without them (a host died in between): one of the
  // 256 record directories of each layout a pass, so a pass costs a stat per 256th record.
  const std::string orphans = Hex16(orphan_sweep_++ % 256).substr(14);
  for (const shared::TierDir::Entry& le : f.pool.List()) {
    Result<shared::TierDir> opened = f.pool.Sub(le.name, false);
    if (!IsDir(f.pool, le) || !opened.ok()) {
      Skipped(f.pool.path() + "/" + le.name, "not a directory (a link is never followed)");
      continue;
    }
    const shared::TierDir& layout = scan.layouts.emplace(le.name, std::move(*opened)).first->second;
    const bool mine = le.name == own;
    for (const shared::TierDir::Entry& sub : layout.List()) {
      const bool kk = sub.name.size() == 2;
      if (!kk && sub.name != "tmp") continue;  // layout, pins, records: read where they are used
      if (!IsDir(layout, sub)) {
        Skipped(layout.path() + "/" + sub.name, "not a directory (a link is never followed)");
        continue;
      }
      for (const shared::TierDir::Entry& e : layout.List(sub.name)) {
        const std::string name = sub.name + "/" + e.name;
        struct stat st{};
        if (!layout.Stat(name, &st)) continue;  // gone meanwhile
        if (!S_ISREG(st.st_mode)) {
          Skipped(layout.path() + "/" + name, "not a regular file (a link is never followed)");
          continue;
        }
        if (!kk) {  // tmp/: a writer or evictor that died mid-way left these
          if (now_s - st.st_mtim.tv_sec > ttl_s && layout.Unlink(name)) ++scan.stale;
          continue;
        }
        scan.files.push_back({Nanoseconds(st.st_atim), static_cast<uint64_t>(st.st_size), le.name, name});
        scan.used += static_cast<uint64_t>(st.st_size);
        BlockKey key;
        if (!mine) continue;
        if (!shared::KeyFromHex(e.name, &key) || e.name.compare(0, 2, sub.name) != 0) {
          Skipped(layout.path() + "/" + name, "not named like a block");
          continue;
        }
        if (!shared::PlausibleBlockSize(static_cast<uint64_t>(st.st_size), block_bytes_)) {
          Skipped(layout.path() + "/" + name, "the wrong size for a block");
          continue;
        }
        const FileId id = IdOf<FileId>(st);
        bool ok = Verified(key, id);
        if (!ok) {
          const UniqueFd fd = layout.OpenToCheck(name);
          struct stat now{};
          ok = fd.valid() && ::fstat(fd.get(), &now) == 0 && now.st_ino == st.st_ino && S_ISREG(now.st_mode) &&
               HeaderVerifies(key, fd.get(), IdOf<FileId>(now));
        }
        if (ok) {
          scan.blocks.emplace_back(Nanoseconds(st.st_atim), key);
        } else {
          Skipped(layout.path() + "/" + name, "its header does not verify (written without the pool's secret?)");
        }
      }
    }
    const std::string records = "records/" + orphans;
    for (const shared::TierDir::Entry& e : layout.List(records)) {
      struct stat st{};
      const std::string name = records + "/" + e.name;
      if (layout.Stat(orphans + "/" + e.name, &st) || !layout.Stat(name, &st) || !S_ISREG(st.st_mode)) continue;
      if (now_s - st.st_mtim.tv_sec > ttl_s && layout.Unlink(name)) ++scan.stale;
    }
  }
  return scan;
}

// How much to free: over the tier's capacity, or over the filesystem's watermark when others'
// files fill it.
uint64_t SharedTier::Excess(uint64_t used) const {
  uint64_t excess = 0;
  if (used > options_.high_watermark * capacity_) excess = used - static_cast<uint64_t>(options_.low_watermark * capacity_);
  if (FsUse fs; UsageOf(files_->pool.fd(), &fs) && fs.size > 0) {
    const auto fs_used = static_cast<double>(fs.used), total = static_cast<double>(fs.size);
    if (fs_used > options_.high_watermark * total) {
      excess = std::max(excess, static_cast<uint64_t>(fs_used - options_.low_watermark * total));
    }
  }
  return excess;
}

// What taking aside did: counts for the stats, and this layout's blocks it deleted.
struct SharedTier::Eviction {
  uint64_t freed = 0, evicted = 0, restored = 0, spared = 0;
  std::unordered_set<BlockKey, BlockKeyHash> gone;
};

namespace {

// Adds "<layout>/<key>" of every block with a live pin marker in `dir` to `out`; markers older
// than `ttl_s` are a dead host's, removed.
void ReadPins(const shared::TierDir& dir, const std::string& layout, int64_t now_s, int64_t ttl_s,
              std::unordered_set<std::string>& out) {
  for (const shared::TierDir::Entry& e : dir.List("pins")) {
    struct stat st{};
    const std::string name = "pins/" + e.name;
    if (!dir.Stat(name, &st) || !S_ISREG(st.st_mode)) continue;
    if (now_s - st.st_mtim.tv_sec > ttl_s) {
      dir.Unlink(name);
      continue;
    }
    out.insert(layout + "/" + e.name.substr(0, e.name.find('.')));
  }
}

std::string PinKeyOf(const std::string& layout, const std::string& name) { return layout + "/" + name.substr(3); }

// The pins of `layouts`, each layout's directory read once.
std::unordered_set<std::string> PinsOf(const std::unordered_map<std::string, shared::TierDir>& dirs,
                                       const std::unordered_set<std::string>& layouts, int64_t now_s, int64_t ttl_s) {
  std::unordered_set<std::string> pinned;
  for (const std::string& layout : layouts) ReadPins(dirs.at(layout), layout, now_s, ttl_s, pinned);
  return pinned;
}

}  // namespace

// Choose: the indices of every file, the least recently read first; none when there is nothing
// to free.
std::vector<size_t> SharedTier::Choose(const Scan& scan, uint64_t excess) const {
  if (excess == 0) return {};
  std::vector<size_t> order(scan.files.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return scan.files[a].atime < scan.files[b].atime; });
  return order;
}

// Take aside, round by round: renamed so no reader finds them, then the pins read (after every
// rename: a pin made before a rename is seen), pinned victims put back and the rest deleted,
// until `excess` bytes are freed. What was pinned when the pass began is never taken aside.
SharedTier::Eviction SharedTier::TakeAside(const Scan& scan, std::span<const size_t> order, uint64_t excess,
                                           int64_t now_s, int64_t ttl_s) {
  Eviction ev;
  std::unordered_set<std::string> chosen_layouts;
  for (size_t i : order) chosen_layouts.insert(scan.files[i].layout);
  const std::unordered_set<std::string> pinned_at_start = PinsOf(scan.layouts, chosen_layouts, now_s, ttl_s);
  const std::string own = Hex16(files_->keys.fingerprint());
  size_t next = 0;
  while (ev.freed < excess && next < order.size()) {
    std::vector<std::pair<const Scan::File*, std::string>> aside;
    std::unordered_set<std::string> aside_layouts;
    for (uint64_t round = ev.freed; round < excess && next < order.size(); ++next) {
      const Scan::File& file = scan.files[order[next]];
      if (pinned_at_start.count(PinKeyOf(file.layout, file.name)) != 0) {
        ++ev.spared;
        continue;
      }
      const shared::TierDir& dir = scan.layouts.at(file.layout);
      const std::string moved = "tmp/" + file.name.substr(3) + ".evict." + instance_;
      if (!dir.RenameTo(file.name, dir, moved)) continue;  // another evictor's
      aside.emplace_back(&file, moved);
      aside_layouts.insert(file.layout);
      round += file.bytes;
    }
    const std::unordered_set<std::string> pinned = PinsOf(scan.layouts, aside_layouts, now_s, ttl_s);
    for (const auto& [file, moved] : aside) {
      const shared::TierDir& dir = scan.layouts.at(file->layout);
      if (pinned.count(PinKeyOf(file->layout, file->name)) != 0) {
        if (dir.RenameTo(moved, dir, file->name)) ++ev.restored;
      } else if (dir.Unlink(moved)) {
        dir.Unlink("records/" + file->name);
        ++ev.evicted;
        ev.freed += file->bytes;
        BlockKey key;
        if (file->layout == own && shared::KeyFromHex(file->name.substr(3), &key)) ev.gone.insert(key);
      }
    }
  }
  return ev;
}

// This layout's catalog, most recently read first, and what changed since the last pass: the
// blocks evicted here, published since, or removed elsewhere.
void SharedTier::UpdateCatalog(Scan& scan, const Eviction& ev) {
  std::sort(scan.blocks.begin(), scan.blocks.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<BlockKey> catalog;
  for (const auto& [atime, key] : scan.blocks) {
    if (ev.gone.count(key) == 0) catalog.push_back(key);
  }
  std::vector<BlockKey> changed(ev.gone.begin(), ev.gone.end());
  {
    std::lock_guard lock(mu_);
    if (scanned_) {
      const std::unordered_set<BlockKey, BlockKeyHash> before(catalog_.begin(), catalog_.end());
      const std::unordered_set<BlockKey, BlockKeyHash> after(catalog.begin(), catalog.end());
      for (const BlockKey& k : catalog) {
        if (before.count(k) == 0) changed.push_back(k);  // published since
      }
      for (const BlockKey& k : catalog_) {
        if (after.count(k) == 0 && ev.gone.count(k) == 0) changed.push_back(k);  // removed elsewhere
      }
    }
    scanned_ = true;
    catalog_ = std::move(catalog);
    stats_.blocks = catalog_.size();
    stats_.used_bytes = scan.used - ev.freed;
    stats_.evictions += ev.evicted;
    stats_.evicted_bytes += ev.freed;
    stats_.pins_restored += ev.restored;
    stats_.pins_spared += ev.spared;
    stats_.stale_files_removed += scan.stale;
  }
  for (const BlockKey& k : changed) Changed(k);
}

Result<uint64_t> SharedTier::EvictOnce() {
  std::lock_guard one_pass(scan_mu_);
  const int64_t now_s =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  const int64_t ttl_s = std::max<int64_t>(1, std::chrono::duration_cast<std::chrono::seconds>(options_.pin_ttl).count());
  Scan scan = ScanPool(now_s, ttl_s);
  const uint64_t excess = Excess(scan.used);
  const std::vector<size_t> order = Choose(scan, excess);
  const Eviction ev = TakeAside(scan, order, excess, now_s, ttl_s);
  UpdateCatalog(scan, ev);
  return ev.evicted;
}

}  // namespace tpusync
