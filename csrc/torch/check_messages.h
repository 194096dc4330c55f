// Error messages that an op's checks and its fake (python/moeext/_fake.py) both raise, each
// written once, in the op's binding file. The C++ checks fill them in here; the fakes get the
// same texts from moeext._C.check_messages() and fill them in with str.format. A text names
// its fields in braces: "{op}: topk must be >= 1, got {topk}". Messages that only the kernels
// can check (strides, shared memory, the device's own limits) stay inline in their checks.
#pragma once

#include <c10/util/StringUtil.h>

#include <initializer_list>
#include <string>
#include <vector>

namespace moeext::torch_glue {

struct MessageField {
  template <typename T>
  MessageField(const char* field_name, const T& field_value)
      : name(field_name), value(c10::str(field_value)) {}
  const char* name;
  std::string value;
};

struct CheckMessage {
  const char* key;   // "<op family>.<what>", the name a fake asks for
  const char* text;  // with {field}s
  // The text with every field filled in; a field the text names but the call does not give
  // is an internal error (the tests raise every message at least once).
  std::string operator()(std::initializer_list<MessageField> fields) const;
};

// Makes an op file's messages known to moeext._C.check_messages(): one static instance per
// file, constructed when the library loads.
struct CheckMessages {
  CheckMessages(std::initializer_list<const CheckMessage*> messages);
};

const std::vector<const CheckMessage*>& registered_check_messages();

// The messages of several ops.
extern const CheckMessage kFloatDtype;  // {op} {arg} {dtype}
extern const CheckMessage kSameDevice;  // {op} {arg} {device} {other} {other_device}

}  // namespace moeext::torch_glue
