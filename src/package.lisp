(defpackage #:hunchentoot-recycling-taskmaster
  (:use #:cl)
  (:export
   ;; Acceptors: Hunchentoot's four acceptor classes, each with a
   ;; RECYCLING-TASKMASTER as its default taskmaster.
   #:parallel-acceptor
   #:parallel-easy-acceptor
   #:parallel-ssl-acceptor
   #:parallel-easy-ssl-acceptor
   #:abandon-acceptor

   ;; The taskmaster and its configuration.
   #:recycling-taskmaster
   #:*default-standby-thread-count*
   #:taskmaster-standby-thread-count
   #:taskmaster-thread-idle-timeout
   #:taskmaster-stop-timeout

   ;; Observing a running pool.
   #:taskmaster-statistics

   ;; Conditions.
   #:recycling-taskmaster-error
   #:recycling-taskmaster-corrupted-error
   #:invalid-taskmaster-configuration
   #:acceptor-not-parallel-error))
