// Everything qkv offers: #include <qkv/qkv.h>.
#pragma once

#include <qkv/functional.h>
#include <qkv/masks.h>
#include <qkv/options.h>
#include <qkv/self_attention.h>
#include <qkv/state_dict.h>
#include <qkv/version.h>
