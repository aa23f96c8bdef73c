# glake_require_test_cases(<list>...): every test in the named lists of discovered doctest tests
# (doctest_discover_tests' TEST_LIST, <target>_TESTS by default) fails when its filter runs no
# test case. doctest exits 0 for a --test-case filter that matches nothing, printing
# "test cases: 0 | ..."; a name doctest's filter syntax mangles (',' '*' '?' '\') would then pass
# without running. Call it after the directory's last doctest_discover_tests: the lists are known
# only once the discovery scripts, included before this one, have run.
function(glake_require_test_cases)
  set(script "${CMAKE_CURRENT_BINARY_DIR}/glake_require_test_cases.cmake")
  file(WRITE "${script}" "foreach(list IN ITEMS ${ARGN})
  foreach(test IN LISTS \${list})
    set_tests_properties(\"\${test}\" PROPERTIES FAIL_REGULAR_EXPRESSION \"test cases: +0 [|]\")
  endforeach()
endforeach()
")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${script}")
endfunction()
