#include "tpusync/status.h"

#include <gtest/gtest.h>

namespace tpusync {
namespace {

TEST(ResultTest, HoldsAValueOrTheStatusThatExplainsItsAbsence) {
  Result<int> v = 7;
  EXPECT_TRUE(v.ok());
  EXPECT_EQ(*v, 7);
  EXPECT_TRUE(v.status().ok());
  Result<int> e = NotFound("nothing");
  EXPECT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kNotFound);
}

TEST(ResultTest, AnOkStatusWithoutAValueIsAnError) {
  Result<int> r = Status::Ok();
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);  // never ok() == false with an OK status
}

}  // namespace
}  // namespace tpusync
