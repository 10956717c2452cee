// draft_length.py's `AdaptiveDraftLength` compiled (draft_length.py `adaptive_draft_length` builds and loads this
// file): the same estimates, updated in the same order of float64 operations, so the same choices step for step
// (tests/test_draft_length.py replays random steps through both). Compiled because the Python policy's list work ran
// cold after every target step: ~5% of the default's time at batch 1, where the default then ran 1.02x as fast
// (docs/benchmarks.md, round 30).

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace {

// AcceptanceEstimate: per-position conditional acceptance from decaying counts, `expected_tokens` kept until observed.
class Estimate {
 public:
  Estimate(int64_t most, double decay, double prior, double prior_weight)
      : decay_(decay), prior_(prior), prior_weight_(prior_weight), accepted_(most, 0.0), trials_(most, 0.0) {}

  void observe(int64_t num_drafts, const std::vector<int64_t>& num_accepted) {
    fresh_ = false;
    for (double& a : accepted_) a *= decay_;
    for (double& t : trials_) t *= decay_;
    for (const int64_t kept : num_accepted) {
      const int64_t tried = std::min(kept + 1, num_drafts);
      for (int64_t position = 0; position < tried; ++position) {
        trials_[position] += 1;
        accepted_[position] += position < kept ? 1.0 : 0.0;
      }
    }
  }

  const std::vector<double>& expected_tokens() {
    if (!fresh_) {
      expected_.assign(1, 1.0);
      double survive = 1.0;
      for (size_t j = 0; j < accepted_.size(); ++j) {
        survive *= (accepted_[j] + prior_ * prior_weight_) / (trials_[j] + prior_weight_);
        expected_.push_back(expected_.back() + survive);
      }
      fresh_ = true;
    }
    return expected_;
  }

 private:
  double decay_, prior_, prior_weight_;
  std::vector<double> accepted_, trials_, expected_;
  bool fresh_ = false;
};

// ConfidenceCalibration: acceptance per bucket of the drafter's confidence in a draft.
class Calibration {
 public:
  static constexpr int kBuckets = 10;

  int bucket(double confidence) const { return std::min(static_cast<int>(confidence * kBuckets), kBuckets - 1); }

  double rate(double confidence) const {
    const int b = bucket(confidence);
    return (accepted_[b] + (b + 0.5) / kBuckets * kPriorWeight) / (trials_[b] + kPriorWeight);
  }

  // One row's drafts [count] -> expected committed tokens of verifying its first K, K = 0..count, added to `total`.
  void add_expected(const float* confidences, int64_t count, std::vector<double>& total) const {
    double expected = 1.0, survive = 1.0;
    total[0] += expected;
    for (int64_t j = 0; j < count; ++j) {
      survive *= rate(confidences[j]);
      expected += survive;
      total[j + 1] += expected;
    }
  }

  void observe(const float* confidences, int64_t stride, const std::vector<int64_t>& rows, int64_t count,
               const std::vector<int64_t>& num_accepted) {
    for (double& a : accepted_) a *= kDecay;
    for (double& t : trials_) t *= kDecay;
    for (size_t i = 0; i < rows.size(); ++i) {
      const float* row = confidences + rows[i] * stride;
      const int64_t kept = num_accepted[i], seen = std::min(kept + 1, count);
      for (int64_t position = 0; position < seen; ++position) {
        const int b = bucket(row[position]);
        trials_[b] += 1;
        accepted_[b] += position < kept ? 1.0 : 0.0;
      }
    }
  }

 private:
  static constexpr double kDecay = 0.98, kPriorWeight = 2.0;
  double accepted_[kBuckets] = {}, trials_[kBuckets] = {};
};

struct Source {
  std::vector<double> costs, edges;
  std::vector<Estimate> estimates;  // one per bucket of the rows' keys
  std::vector<int64_t> chosen;
};

class Policy {
 public:
  Policy(const std::map<std::string, std::vector<double>>& costs, int64_t least, double decay,
         const std::map<std::string, double>& priors, double explore_every, double explore_share,
         const std::map<std::string, std::vector<double>>& key_edges)
      : least_(least), explore_every_(explore_every), explore_share_(explore_share) {
    for (const auto& [name, row] : costs) {
      TORCH_CHECK(name == "neural" || name == "suffix", "unknown draft source ", name);
      TORCH_CHECK(row.size() >= 1, "a source's cost row needs K = 0");
      Source& source = sources_[index(name)];
      source.costs = row;
      const auto edges = key_edges.find(name);
      if (edges != key_edges.end()) source.edges = edges->second;
      TORCH_CHECK(source.edges.size() < 62, "at most 61 key edges a source (its buckets are bits of a mask)");
      for (size_t b = 0; b <= source.edges.size(); ++b)
        source.estimates.emplace_back(static_cast<int64_t>(row.size()) - 1, decay, priors.at(name), 1.0);
      present_[index(name)] = true;
    }
  }

  // Step costs measured at another live batch size (`CostTables`): the same sources and lengths; the estimates stay.
  void set_costs(const std::map<std::string, std::vector<double>>& costs) {
    for (const auto& [name, row] : costs) {
      Source& source = get(name);
      TORCH_CHECK(row.size() == source.costs.size(), "new step costs for ", name, " must keep its ",
                  source.costs.size(), " entries");
      source.costs = row;
    }
  }

  int64_t choose(const std::string& name, int64_t most, const std::optional<std::vector<double>>& keys) {
    Source& source = get(name);
    most = std::min(most, static_cast<int64_t>(source.costs.size()) - 1);
    if (most <= least_) {
      source.chosen.push_back(most);
      return most;
    }
    const std::vector<int64_t> rows = buckets(source, keys, 1);
    std::vector<double> value = expected_tokens(source, rows, most);
    for (int64_t k = 0; k <= most; ++k) value[k] /= source.costs[k];
    const int64_t probe = best(value, 1, most);
    int64_t k = best(value, least_, most);
    const double extra = (source.costs[probe] - source.costs[0]) / (explore_share_ * source.costs[0]);
    const double wait = std::max(explore_every_, extra);
    int64_t mask = 0;
    for (const int64_t b : rows) mask |= int64_t{1} << b;
    int64_t& idle = idle_[{index(name), mask}];
    if (k == 0) {
      idle += 1;
      if (idle >= wait) k = probe;
    }
    if (k) idle = 0;
    source.chosen.push_back(k);
    return k;
  }

  // confidences float32 [b, >= most], of which `rows` (default: all) took the drafter's drafts; each row's first
  // `most` are read.
  int64_t truncate(const torch::Tensor& confidences, int64_t most, const std::vector<double>& suffix_keys,
                   const std::optional<std::vector<int64_t>>& rows) {
    Source& neural = get("neural");
    most = std::min(most, static_cast<int64_t>(neural.costs.size()) - 1);
    std::vector<double> expected(most + 1, 0.0);
    const torch::Tensor table = checked(confidences);
    const std::vector<int64_t> picked = rows ? *rows : all_rows(table.size(0));
    check_rows(picked, table.size(0));
    for (const int64_t r : picked)
      calibration_.add_expected(table.data_ptr<float>() + r * table.stride(0), std::min(most, table.size(1)),
                                expected);
    if (!suffix_keys.empty()) {
      const std::vector<double> suffix = expected_tokens(get("suffix"), buckets(get("suffix"), suffix_keys, 1), most);
      for (int64_t k = 0; k <= most; ++k) expected[k] += suffix[k];
    }
    int64_t k = 1;
    for (int64_t j = 2; j <= most; ++j)
      if (expected[j] / neural.costs[j] > expected[k] / neural.costs[k]) k = j;
    TORCH_CHECK(!neural.chosen.empty(), "truncate follows a choose of the neural source");
    neural.chosen.back() = k;
    return k;
  }

  void observe(const std::string& name, int64_t num_drafts, const std::vector<int64_t>& num_accepted,
               const std::optional<std::vector<double>>& keys) {
    if (!num_drafts || num_accepted.empty()) return;
    Source& source = get(name);
    const std::vector<int64_t> rows = buckets(source, keys, static_cast<int64_t>(num_accepted.size()));
    if (rows.size() == 1) {
      source.estimates[rows[0]].observe(num_drafts, num_accepted);
      return;
    }
    std::vector<int64_t> present(rows);
    std::sort(present.begin(), present.end());
    present.erase(std::unique(present.begin(), present.end()), present.end());
    for (const int64_t bucket : present) {
      std::vector<int64_t> kept;
      for (size_t i = 0; i < rows.size(); ++i)
        if (rows[i] == bucket) kept.push_back(num_accepted[i]);
      source.estimates[bucket].observe(num_drafts, kept);
    }
  }

  // A drafter step's rows: `observe("neural", ...)` and the calibration of their confidences [b, num_drafts]; `rows`
  // picks the neural rows of the batch (num_accepted is the batch's).
  void observe_drafter(int64_t num_drafts, const std::vector<int64_t>& num_accepted, const torch::Tensor& confidences,
                       const std::optional<std::vector<int64_t>>& rows) {
    if (!num_drafts || num_accepted.empty()) return;
    const std::vector<int64_t> picked = rows ? *rows : all_rows(static_cast<int64_t>(num_accepted.size()));
    const torch::Tensor table = checked(confidences);
    check_rows(picked, std::min(table.size(0), static_cast<int64_t>(num_accepted.size())));
    std::vector<int64_t> kept;
    for (const int64_t r : picked) kept.push_back(num_accepted[r]);
    if (kept.empty()) return;
    observe("neural", num_drafts, kept, std::nullopt);
    calibration_.observe(table.data_ptr<float>(), table.stride(0), picked, table.size(1), kept);
  }

  // What a step of rows with these keys expects to commit at K = 0, 1, ... (`AdaptiveDraftLength.expected_tokens`).
  std::vector<double> expected_tokens(const std::string& name, const std::optional<std::vector<double>>& keys) {
    Source& source = get(name);
    return expected_tokens(source, buckets(source, keys, 1), static_cast<int64_t>(source.costs.size()) - 1);
  }

  // What one row of drafts of these confidences expects to commit (`ConfidenceCalibration.expected_tokens`).
  std::vector<double> calibrated_tokens(const std::vector<float>& confidences) const {
    std::vector<double> total(confidences.size() + 1, 0.0);
    calibration_.add_expected(confidences.data(), static_cast<int64_t>(confidences.size()), total);
    return total;
  }

  std::map<std::string, std::vector<int64_t>> chosen() const {
    std::map<std::string, std::vector<int64_t>> out;
    for (int i = 0; i < 2; ++i)
      if (present_[i]) out[i ? "suffix" : "neural"] = sources_[i].chosen;
    return out;
  }

 private:
  static int index(const std::string& name) { return name == "suffix" ? 1 : 0; }

  static void check_rows(const std::vector<int64_t>& rows, int64_t count) {
    for (const int64_t r : rows) TORCH_CHECK(r >= 0 && r < count, "row ", r, " is outside the batch of ", count);
  }

  static std::vector<int64_t> all_rows(int64_t count) {
    std::vector<int64_t> rows(count);
    for (int64_t r = 0; r < count; ++r) rows[r] = r;
    return rows;
  }

  Source& get(const std::string& name) {
    const int i = index(name);
    TORCH_CHECK(present_[i] && (i == 1 || name == "neural"), "no step costs for draft source ", name);
    return sources_[i];
  }

  // A float32 CPU view whose rows are contiguous (a slice of the drafter's CPU confidences [b, K] is taken as it is;
  // a GPU drafter's are copied here, as Python's `tolist` would).
  static torch::Tensor checked(const torch::Tensor& confidences) {
    TORCH_CHECK(confidences.dim() == 2, "confidences must be a tensor [rows, K]");
    if (confidences.device().is_cpu() && confidences.scalar_type() == torch::kFloat32 &&
        (confidences.stride(1) == 1 || confidences.size(1) <= 1))
      return confidences;
    return confidences.to(torch::kCPU, torch::kFloat32).contiguous();
  }

  // Each row's bucket: bisect_right over the source's edges; no keys: bucket 0 for each of `rows` rows.
  static std::vector<int64_t> buckets(const Source& source, const std::optional<std::vector<double>>& keys,
                                      int64_t rows) {
    if (!keys) return std::vector<int64_t>(rows, 0);
    std::vector<int64_t> out;
    for (const double key : *keys)
      out.push_back(std::upper_bound(source.edges.begin(), source.edges.end(), key) - source.edges.begin());
    return out;
  }

  // Expected committed tokens of a step with K = 0..most drafts, summed over rows in these buckets (in row order).
  static std::vector<double> expected_tokens(Source& source, const std::vector<int64_t>& rows, int64_t most) {
    std::vector<double> total(most + 1, 0.0);
    for (const int64_t b : rows) {
      const std::vector<double>& row = source.estimates[b].expected_tokens();
      for (int64_t k = 0; k <= most; ++k) total[k] += row[k];
    }
    return total;
  }

  // The first K in [from, to] of the largest value (Python's `max` over the range keeps the first).
  static int64_t best(const std::vector<double>& value, int64_t from, int64_t to) {
    int64_t k = from;
    for (int64_t j = from + 1; j <= to; ++j)
      if (value[j] > value[k]) k = j;
    return k;
  }

  int64_t least_;
  double explore_every_, explore_share_;
  Source sources_[2];
  bool present_[2] = {false, false};
  Calibration calibration_;
  std::map<std::pair<int, int64_t>, int64_t> idle_;  // steps in a row without drafts, per source and set of buckets
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Policy>(m, "Policy")
      .def(py::init<const std::map<std::string, std::vector<double>>&, int64_t, double,
                    const std::map<std::string, double>&, double, double,
                    const std::map<std::string, std::vector<double>>&>())
      .def("set_costs", &Policy::set_costs, py::arg("costs"))
      .def("choose", &Policy::choose, py::arg("source"), py::arg("most"), py::arg("keys") = py::none())
      .def("truncate", &Policy::truncate, py::arg("confidences"), py::arg("most"),
           py::arg("suffix_keys") = std::vector<double>(), py::arg("rows") = py::none())
      .def("observe", &Policy::observe, py::arg("source"), py::arg("num_drafts"), py::arg("num_accepted"),
           py::arg("keys") = py::none())
      .def("observe_drafter", &Policy::observe_drafter, py::arg("num_drafts"), py::arg("num_accepted"),
           py::arg("confidences"), py::arg("rows") = py::none())
      .def("expected_tokens", py::overload_cast<const std::string&, const std::optional<std::vector<double>>&>(
                                  &Policy::expected_tokens),
           py::arg("source"), py::arg("keys") = py::none())
      .def("calibrated_tokens", &Policy::calibrated_tokens)
      .def_property_readonly("chosen", &Policy::chosen);
}
