;;;; The listening socket of a parallel acceptor: its own (as Hunchentoot
;;;; makes it, or with SO_REUSEPORT), or one that reached it from outside --
;;;; a descriptor inherited from a supervisor (:LISTEN-FD, systemd's socket
;;;; activation), or a socket an application's own START-LISTENING method
;;;; made or adopted.  Only a socket of its own is shut down at a soft STOP
;;;; (ENGINE-DRAIN); one from outside may be listened on by the next
;;;; process, and is left listening.

(in-package #:hunchentoot-recycling-taskmaster)

(defmethod hunchentoot:start-listening ((acceptor parallel-acceptor))
  "Serve the inherited :LISTEN-FD, or listen with SO_REUSEPORT when
:REUSE-PORT is true; otherwise listen as Hunchentoot does."
  (let ((fd (acceptor-listen-fd acceptor)))
    (cond (fd
           (unless (listening-descriptor-p fd)
             (error 'invalid-acceptor-configuration
                    :initarg :listen-fd :value fd
                    :reason "is not a socket that listens"))
           (setf (acceptor-listen-socket acceptor) (adopt-listening-descriptor fd)))
          ((acceptor-reuse-port-p acceptor)
           (setf (acceptor-listen-socket acceptor)
                 (listen-on (listen-address-vector (hunchentoot:acceptor-address acceptor))
                            (hunchentoot:acceptor-port acceptor)
                            (hunchentoot:acceptor-listen-backlog acceptor)
                            :reuse-port t)
                 (acceptor-own-listen-socket acceptor) (acceptor-listen-socket acceptor)))
          (t (call-next-method)
             (setf (acceptor-own-listen-socket acceptor) (acceptor-listen-socket acceptor)))))
  ;; Nagle's algorithm would hold a reply written in several pieces (TLS
  ;; records, a SEND-HEADERS stream) or the replies to pipelined requests
  ;; after the first until the client's delayed acknowledgement, 40 ms
  ;; later.  Set on the listening socket, every connection inherits it,
  ;; without a system call of its own.
  (send-small-writes-at-once (socket-file-descriptor (acceptor-listen-socket acceptor)))
  (when (acceptor-defer-accept-p acceptor)
    ;; Where the kernel refuses it, connections are handed over at once,
    ;; as without it: nothing else changes.
    (defer-accepting-until-data (socket-file-descriptor (acceptor-listen-socket acceptor))
                                (ceiling (acceptor-header-timeout acceptor))))
  (values))

(defun systemd-listen-fd ()
  "The listening descriptor systemd's socket activation (or
systemd-socket-activate, or any supervisor following its protocol) passed
to this process -- 3, when LISTEN_PID is this process and LISTEN_FDS at
least 1 -- else NIL.  Give it as :LISTEN-FD.  Only the first descriptor
passed is taken."
  (let ((listen-pid (uiop:getenv "LISTEN_PID"))
        (listen-fds (uiop:getenv "LISTEN_FDS")))
    (and listen-pid listen-fds
         (eql (parse-integer listen-pid :junk-allowed t) (process-id))
         (let ((count (parse-integer listen-fds :junk-allowed t)))
           (and count (<= 1 count)))
         3)))

(defun listen-address-vector (address)
  "The octets of the address ADDRESS (text, a host name, or NIL for every
IPv4 address) names."
  (cond ((null address) (vector 0 0 0 0))
        ((find #\: address) (usocket:ipv6-host-to-vector address))
        ((every (lambda (char) (or (digit-char-p char) (char= char #\.))) address)
         (usocket:dotted-quad-to-vector-quad address))
        (t (usocket:get-host-by-name address))))

(defun own-listen-socket-p (acceptor)
  "True when ACCEPTOR's listening socket is one its START-LISTENING method
opened, not one that reached it from outside."
  (let ((socket (acceptor-listen-socket acceptor)))
    (and socket (eq socket (acceptor-own-listen-socket acceptor)))))

(defun release-listen-socket (acceptor)
  "Close ACCEPTOR's listening socket, unless it was inherited: that one stays
open and listening (and non-blocking: another acceptor may share it).
Closing a socket that reached it from outside closes only this process's
descriptor of it."
  (setf (acceptor-own-listen-socket acceptor) nil)
  (let ((socket (shiftf (acceptor-listen-socket acceptor) nil)))
    (when (and socket (not (acceptor-listen-fd acceptor)))
      (ignore-errors (usocket:socket-close socket)))))

