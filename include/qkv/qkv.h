// Everything qkv offers: #include <qkv/qkv.h>.
#pragma once

#include <qkv/checkpoint.h>
#include <qkv/functional.h>
#include <qkv/kv_cache.h>
#include <qkv/masks.h>
#include <qkv/options.h>
#include <qkv/precision.h>
#include <qkv/self_attention.h>
#include <qkv/state_dict.h>
#include <qkv/transformer_block.h>
#include <qkv/version.h>
