(defpackage #:hunchentoot-recycling-taskmaster-test
  (:use #:cl #:fiveam #:hunchentoot-recycling-taskmaster)
  (:local-nicknames (#:ht #:hunchentoot))
  (:export #:run-tests))
