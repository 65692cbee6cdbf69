;;;; Loaded first by every make target: ASDF, and this checkout as a place
;;;; to find systems, besides Debian's /usr/share/common-lisp.

(require :asdf)
(asdf:initialize-source-registry
 `(:source-registry
   (:directory ,(uiop:pathname-parent-directory-pathname
                 (uiop:pathname-directory-pathname *load-truename*)))
   :inherit-configuration))
