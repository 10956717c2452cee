// suffix_index.py's `SuffixIndex` compiled (suffix_index.py `SuffixIndexes` builds and loads this file): the same
// online suffix automaton with the same answers, and a batch's work of a step in one call each (`match`, then
// `verify_block`). The Python index's per-token dict and list operations run cold after every target step and grow
// with the batch: the default ran 1.02x as fast with this at batch 1, 4 and 8 (docs/benchmarks.md, round 29).

#include <torch/extension.h>

#include <cstdint>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

class SuffixIndex {
 public:
  SuffixIndex() { new_state(0, -1, -1); }

  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }

  // Appends the tokens of `sequence` (a list of ints: the loop's committed tokens, grown in place) past those indexed.
  void sync(PyObject* sequence) {
    TORCH_CHECK(PyList_Check(sequence), "each row of the history must be a list of token ids");
    const int64_t n = PyList_GET_SIZE(sequence);
    for (int64_t i = size(); i < n; ++i) {
      const int64_t token = PyLong_AsLongLong(PyList_GET_ITEM(sequence, i));
      if (token == -1 && PyErr_Occurred()) throw py::error_already_set();
      append(token);
    }
  }

  void extend(const std::vector<int64_t>& tokens) {
    for (const int64_t token : tokens) append(token);
  }

  int64_t match_length() const { return tokens_.empty() ? 0 : length_[link_[last_]]; }

  int64_t match_end() const { return match_end_; }

  // The `count` tokens after the earlier occurrence of the longest repeated suffix, continued from themselves where
  // they run past the end (the repeat's period), as suffix_index.py's `continuation`.
  void continuation(int64_t count, int64_t* out) const {
    const int64_t first = match_end_ + 1, period = size() - first;
    for (int64_t j = 0; j < count; ++j) out[j] = j < period ? tokens_[first + j] : out[j - period];
  }

  std::vector<int64_t> continuation_list(int64_t count) const {
    std::vector<int64_t> out(count);
    continuation(count, out.data());
    return out;
  }

  int64_t last_token() const {
    TORCH_CHECK(!tokens_.empty(), "an empty suffix index has no last token");
    return tokens_.back();
  }

 private:
  int32_t new_state(int64_t length, int32_t link, int64_t end) {
    next_.emplace_back();
    length_.push_back(length);
    link_.push_back(link);
    end_.push_back(end);
    return static_cast<int32_t>(length_.size() - 1);
  }

  void append(int64_t token) {  // the standard online construction, as suffix_index.py's `append`
    const int64_t position = size();
    tokens_.push_back(token);
    const int32_t current = new_state(length_[last_] + 1, 0, position);
    int32_t state = last_;
    while (state != -1 && !next_[state].count(token)) {
      next_[state][token] = current;
      state = link_[state];
    }
    if (state != -1) {
      const int32_t target = next_[state][token];
      if (length_[state] + 1 == length_[target]) {
        link_[current] = target;
      } else {  // split: a clone takes the shorter strings of `target`
        const int32_t clone = new_state(length_[state] + 1, link_[target], end_[target]);
        next_[clone] = next_[target];
        for (; state != -1; state = link_[state]) {
          const auto found = next_[state].find(token);
          if (found == next_[state].end() || found->second != target) break;
          found->second = clone;
        }
        link_[target] = link_[current] = clone;
      }
    }
    last_ = current;
    const int32_t answer = link_[current];
    match_end_ = end_[answer];  // before this position is recorded: an earlier occurrence
    end_[answer] = position;
  }

  std::vector<int64_t> tokens_;
  std::vector<std::unordered_map<int64_t, int32_t>> next_;  // per state: token -> state
  std::vector<int64_t> length_, end_;
  std::vector<int32_t> link_;
  int32_t last_ = 0;
  int64_t match_end_ = -1;
};

// Each index brought up to its row of `history` (a list of lists) -> each row's match length.
std::vector<int64_t> match(const std::vector<SuffixIndex*>& indexes, const py::list& history) {
  TORCH_CHECK(static_cast<size_t>(PyList_GET_SIZE(history.ptr())) == indexes.size(),
              "the history must have one row per index");
  std::vector<int64_t> lengths(indexes.size());
  for (size_t i = 0; i < indexes.size(); ++i) {
    indexes[i]->sync(PyList_GET_ITEM(history.ptr(), i));
    lengths[i] = indexes[i]->match_length();
  }
  return lengths;
}

// The verify block of a step whose rows all take suffix drafts: int64 [b, 1 + count], each row's newest token (its
// anchor), then its continuation.
torch::Tensor verify_block(const std::vector<SuffixIndex*>& indexes, int64_t count) {
  auto block = torch::empty({static_cast<int64_t>(indexes.size()), 1 + count}, torch::kLong);
  int64_t* row = block.data_ptr<int64_t>();
  for (const SuffixIndex* index : indexes) {
    row[0] = index->last_token();
    index->continuation(count, row + 1);
    row += 1 + count;
  }
  return block;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<SuffixIndex>(m, "SuffixIndex")
      .def(py::init<>())
      .def("extend", &SuffixIndex::extend)
      .def("match_length", &SuffixIndex::match_length)
      .def_property_readonly("match_end", &SuffixIndex::match_end)
      .def("continuation", &SuffixIndex::continuation_list);
  m.def("match", &match, "each index brought up to its row of the history -> the rows' match lengths");
  m.def("verify_block", &verify_block, "the verify block of an all-suffix step");
}
