// SHA-256 against FIPS 180-2's examples and HMAC-SHA256 against RFC 4231.
#include <string>

#include "../core/transport/tcp/hmac.h"
#include "harness.h"

namespace kr_test {
namespace {

using keras_ring::HmacSha256;
using keras_ring::Sha256;
using keras_ring::Sha256Digest;

std::string Hex(const Sha256Digest& d) {
  static const char kDigits[] = "0123456789abcdef";
  std::string s;
  for (uint8_t b : d) {
    s += kDigits[b >> 4];
    s += kDigits[b & 15];
  }
  return s;
}

std::string Sha256Hex(const std::string& message) {
  Sha256 h;
  h.Update(message);
  return Hex(h.Finish());
}

KR_TEST(Sha256KnownVectors) {
  KR_EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  KR_EXPECT_EQ(Sha256Hex("abc"),
               "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  KR_EXPECT_EQ(Sha256Hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
               "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  KR_EXPECT_EQ(Sha256Hex(std::string(1000000, 'a')),
               "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

KR_TEST(Sha256UpdateInPieces) {
  // Splits across block and padding boundaries give the one-shot digest.
  std::string message;
  for (int i = 0; i < 300; ++i) message += static_cast<char>(i * 7);
  const std::string whole = Sha256Hex(message);
  for (size_t split : {1, 55, 56, 63, 64, 65, 128, 299}) {
    Sha256 h;
    h.Update(message.data(), split);
    h.Update(message.data() + split, message.size() - split);
    KR_EXPECT_EQ(Hex(h.Finish()), whole);
  }
}

KR_TEST(HmacSha256Rfc4231) {
  std::string key4;
  for (int i = 1; i <= 25; ++i) key4 += static_cast<char>(i);
  const std::string big_key(131, '\xaa');
  KR_EXPECT_EQ(Hex(HmacSha256(std::string(20, '\x0b'), "Hi There")),
               "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  KR_EXPECT_EQ(Hex(HmacSha256("Jefe", "what do ya want for nothing?")),
               "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  KR_EXPECT_EQ(Hex(HmacSha256(std::string(20, '\xaa'), std::string(50, '\xdd'))),
               "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
  KR_EXPECT_EQ(Hex(HmacSha256(key4, std::string(50, '\xcd'))),
               "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b");
  KR_EXPECT_EQ(Hex(HmacSha256(big_key, "Test Using Larger Than Block-Size Key - Hash Key First")),
               "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  KR_EXPECT_EQ(Hex(HmacSha256(big_key,
                              "This is a test using a larger than block-size key and a larger "
                              "than block-size data. The key needs to be hashed before being "
                              "used by the HMAC algorithm.")),
               "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");
}

KR_TEST(DigestsEqualComparesEveryByte) {
  const Sha256Digest a = HmacSha256("k", "m");
  for (size_t i = 0; i < a.size(); ++i) {
    Sha256Digest b = a;
    b[i] ^= 1;
    KR_EXPECT(!keras_ring::DigestsEqual(a, b));
  }
  KR_EXPECT(keras_ring::DigestsEqual(a, HmacSha256("k", "m")));
}

}  // namespace
}  // namespace kr_test
