#include "torch/check_messages.h"

#include <c10/util/Exception.h>

#include <cstring>

namespace moeext::torch_glue {
namespace {

std::vector<const CheckMessage*>& registry() {
  static std::vector<const CheckMessage*> messages;
  return messages;
}

}  // namespace

std::string CheckMessage::operator()(std::initializer_list<MessageField> fields) const {
  std::string out;
  for (const char* at = text; *at != '\0';) {
    const char* open = std::strchr(at, '{');
    if (open == nullptr) {
      out += at;
      break;
    }
    out.append(at, open);
    const char* close = std::strchr(open, '}');
    TORCH_INTERNAL_ASSERT(close != nullptr, "check message ", key, ": unclosed field");
    const std::string name(open + 1, close);
    const MessageField* field = nullptr;
    for (const MessageField& f : fields) {
      if (name == f.name) field = &f;
    }
    TORCH_INTERNAL_ASSERT(field != nullptr, "check message ", key, ": no value for {", name, "}");
    out += field->value;
    at = close + 1;
  }
  return out;
}

CheckMessages::CheckMessages(std::initializer_list<const CheckMessage*> messages) {
  registry().insert(registry().end(), messages.begin(), messages.end());
}

const std::vector<const CheckMessage*>& registered_check_messages() { return registry(); }

const CheckMessage kFloatDtype{"common.float_dtype",
                               "{op}: {arg} must be float32, bfloat16 or float16, got {dtype}"};
const CheckMessage kSameDevice{"common.same_device",
                               "{op}: {arg} is on {device} but {other} is on {other_device}"};
static const CheckMessages kCommon{&kFloatDtype, &kSameDevice};

}  // namespace moeext::torch_glue
